"""FSDP2 / HSDP compressed-gradient scenarios (ddlcomm.fsdp), run on every rank by tests/test_fsdp.py."""

from __future__ import annotations

import json
import logging

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

from common import ddlcomm_stats, init, run
from compression import synthetic
import fsdp_moments as moments
from ddlcomm import compressors, fsdp
from ddlcomm.compressed import host_levels_of

COMPRESSORS = {
    "onebit": compressors.OneBit,
    "ternary": lambda: compressors.Ternary(block_size=64),
}


def reduce_scatter_math(backend: str, hosts: str = "") -> None:
    """Against plain reduce_scatter_tensor: close for fp16; with 1-bit and error feedback,
    nothing is lost over several calls (what was not delivered is in the residuals). With
    ``hosts`` ("2x2": ranks 0-1 and 2-3 on two named hosts) the ddlcomm group reduces exactly
    inside each host and compresses across: the residual of a rank's chunk is then held only by
    the ranks at that rank's place on each host, which compress the host's sum."""
    rank, n = init(backend)
    layered = bool(hosts)
    native = backend == "ddlcomm"
    if layered and native:
        assert ddlcomm_stats()["topology"] == "2 hosts x 2 ranks", ddlcomm_stats()
    # On gloo with DDLCOMM_ALLREDUCE_ALGO=hierarchical; on ddlcomm from its topology.
    assert (host_levels_of(dist.group.WORLD) is not None) == layered
    m = 1000
    g = torch.Generator().manual_seed(rank)
    state = fsdp.FSDPCompressionState(compressors.FP16(), start_compress_iter=0, min_compression_bytes=0)
    x = torch.randn(n * m, generator=g)
    out, ref = torch.empty(m), torch.empty(m)
    state.reduce_scatter("layer", out, x.clone(), dist.group.WORLD, dist.ReduceOp.AVG)
    dist.reduce_scatter_tensor(ref, x.clone(), op=dist.ReduceOp.AVG)
    assert torch.allclose(out, ref, rtol=2e-3, atol=2e-3), (out - ref).abs().max()

    state = fsdp.FSDPCompressionState(compressors.OneBit(block_size=32), start_compress_iter=0, min_compression_bytes=0)
    delivered, sent = torch.zeros(m, dtype=torch.float64), torch.zeros(n * m, dtype=torch.float64)
    for step in range(5):
        x = torch.randn(n * m, generator=g) * (step + 1)
        sent += x
        state.reduce_scatter("layer", out, x, dist.group.WORLD, dist.ReduceOp.SUM)
        delivered += out
    total = sent.clone()
    dist.all_reduce(total)  # every rank's input, summed
    residuals = [torch.empty(n * m) for _ in range(n)]
    dist.all_gather(residuals, state.residuals["layer"])
    kept = sum(r.double() for r in residuals)[rank * m:(rank + 1) * m]
    expected = total[rank * m:(rank + 1) * m] - kept
    assert torch.allclose(delivered, expected, rtol=1e-5, atol=1e-3), (delivered - expected).abs().max()
    assert state.stats.compressed_buckets == 5 and state.stats.ratio > 10, vars(state.stats)
    one_bit = (delivered - total[rank * m:(rank + 1) * m]).abs().max()
    assert one_bit > 1e-2, "1-bit with error feedback should hold something back"
    if layered:  # the residual of a rank's chunk is held at its place on each host
        holds = [bool(residuals[j][rank * m:(rank + 1) * m].any()) for j in range(n)]
        assert holds == [j % 2 == rank % 2 for j in range(n)], holds
        # bfloat16 (summed in bfloat16 inside the host): within two of its roundings of the plain one.
        xb = torch.randn(n * m, generator=g).bfloat16()
        bf, ref = torch.empty(m, dtype=torch.bfloat16), torch.empty(m, dtype=torch.bfloat16)
        fsdp.FSDPCompressionState(compressors.FP16(), start_compress_iter=0, min_compression_bytes=0).reduce_scatter(
            "bf", bf, xb.clone(), dist.group.WORLD, dist.ReduceOp.AVG)
        dist.reduce_scatter_tensor(ref, xb.clone(), op=dist.ReduceOp.AVG)
        assert torch.allclose(bf.float(), ref.float(), rtol=2 ** -7, atol=2 ** -7), (bf.float() - ref.float()).abs().max()

    # Every rank must compress alike; the first call checks it.
    odd = fsdp.FSDPCompressionState(compressors.Ternary() if rank == 1 else compressors.OneBit(), start_compress_iter=0,
                                    min_compression_bytes=0)
    try:
        odd.reduce_scatter("layer", out, x, dist.group.WORLD, dist.ReduceOp.SUM)
    except ValueError as e:
        assert "another compressor" in str(e), e
    else:
        raise AssertionError("ranks with different compressors were not refused")
    try:
        state.reduce_scatter("layer", torch.empty(m + 1), torch.empty(n * (m + 1)), dist.group.WORLD,
                             dist.ReduceOp.SUM)
    except ValueError as e:
        assert "another model" in str(e), e
    else:
        raise AssertionError("a residual of another size was accepted")
    moments.momentum_math(dist.group.WORLD)
    moments.adam_math(dist.group.WORLD)
    moments.non_finite_averages(dist.group.WORLD)
    moments.on_the_device(dist.group.WORLD)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                torch.nn.ReLU(), torch.nn.Linear(256, 10))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model


def _optimizer(name: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=1e-2)


def _steps(model, opt, x, y, first: int, last: int) -> None:
    rank = dist.get_rank()
    for step in range(first, last):
        idx = torch.randint(0, len(x), (64,), generator=torch.Generator().manual_seed(step * 97 + rank))
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
        opt.step()


def _accuracy(model) -> float:
    test_x, test_y = synthetic(100, samples=2048)
    with torch.no_grad():
        return (model(test_x).argmax(1) == test_y).float().mean().item()


def backends_agree() -> None:
    """ddlcomm and gloo groups train bit for bit alike (same algorithm, same bytes), with
    SGD's momentum in the reduce-scatter."""
    rank, n = init("ddlcomm")
    gloo = dist.new_group(backend="gloo")
    logging.getLogger("ddlcomm").setLevel(logging.ERROR)
    x, y = synthetic(rank, samples=4096)
    for momentum in (0.9, 0.0):  # the compressed all-reduce of the momentum, then the reduce-scatter
        params = []
        for group in (None, gloo):
            model = _model() if group is None else _model_on(group)
            opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9 - momentum)
            state = fsdp.compress_gradients(model, compressors.OneBit(), start_compress_iter=2, min_compression_bytes=0,
                                            momentum=momentum)
            _steps(model, opt, x, y, 0, 20)
            assert state.stats.compressed_buckets > 0 and bool(state.momenta) == bool(momentum)
            params.append(torch.cat([p.full_tensor().flatten() for p in model.parameters()]))
        assert torch.equal(params[0], params[1]), f"ddlcomm and gloo trained differently (momentum={momentum})"


def state_reduce_scatters_alike() -> None:
    """``FSDPCompressionState.reduce_scatter`` on a ddlcomm group (its own all-to-all) and on a
    gloo group (gloo's) gives the same output and residual bits, for every compressor, dtype and
    op (AVG and SUM), over two calls (the residuals carry over); random-k with a NaN on one rank
    and ranks with different sizes on both."""
    rank, n = init("ddlcomm")
    gloo = dist.new_group(backend="gloo")
    logging.getLogger("ddlcomm").setLevel(logging.ERROR)
    makers = {"onebit": compressors.OneBit, "onebit2": lambda: compressors.OneBit(block_size=64, two_scales=True),
                   "ternary": lambda: compressors.Ternary(block_size=64, stochastic=True, seed=3),
                   "topk": lambda: compressors.TopK(ratio=0.05), "randomk": lambda: compressors.RandomK(ratio=0.1, seed=5),
                   "fp16": compressors.FP16, "bf16": compressors.BF16}
    for name, make in makers.items():
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            for m in (1, 1000, 70_001):
                states = [fsdp.FSDPCompressionState(make(), start_compress_iter=0, min_compression_bytes=0)
                          for _ in range(2)]
                g = torch.Generator().manual_seed(rank * 1000 + m)
                for op in (dist.ReduceOp.AVG, dist.ReduceOp.SUM):
                    x = (torch.randn(n * m, generator=g) * (rank + 1)).to(dtype)
                    outs = [torch.full((m,), float("nan"), dtype=dtype) for _ in range(2)]
                    for state, group, out in zip(states, (dist.group.WORLD, gloo), outs):
                        state.reduce_scatter("layer", out, x.clone(), group, op)
                    what = f"{name} {dtype} m={m} {op}"
                    assert torch.equal(outs[0], outs[1]), f"{what}: outputs differ by {(outs[0] - outs[1]).abs().max()}"
                    assert torch.equal(states[0].residuals["layer"], states[1].residuals["layer"]), f"{what}: residuals"
                    if name in ("fp16", "bf16") and dtype == torch.float32:  # close to the plain reduce-scatter
                        ref = torch.empty(m, dtype=dtype)
                        dist.reduce_scatter_tensor(ref, x.clone(), op=op, group=gloo)
                        scale = ref.abs().max().item() + 1
                        assert (outs[0] - ref).abs().max() < 1e-2 * scale, f"{what}: far from reduce_scatter_tensor"
    # Random-k can miss a NaN in its sample: the output is NaN everywhere all the same, and the
    # residual is left as it was.
    for group in (dist.group.WORLD, gloo):
        state = fsdp.FSDPCompressionState(compressors.RandomK(ratio=0.01, seed=5), start_compress_iter=0,
                                          min_compression_bytes=0)
        out = torch.empty(1000)
        state.reduce_scatter("layer", out, torch.randn(n * 1000), group, dist.ReduceOp.AVG)
        before = state.residuals["layer"].clone()
        x = torch.randn(n * 1000)
        if rank == 1:
            x[3] = float("nan")
        state.reduce_scatter("layer", out, x, group, dist.ReduceOp.AVG)
        assert out.isnan().all(), f"random-k: {int((~out.isnan()).sum())} outputs are not NaN"
        assert torch.equal(state.residuals["layer"], before), "random-k: the skipped call changed the residual"
    # Mismatched sizes across ranks are refused.
    state = fsdp.FSDPCompressionState(compressors.OneBit(), start_compress_iter=0, min_compression_bytes=0)
    m = 100 + (rank == 1)
    try:
        state.reduce_scatter("odd", torch.empty(m), torch.randn(n * m), dist.group.WORLD, dist.ReduceOp.SUM)
    except ValueError as e:
        assert "disagree" in str(e), e
    else:
        raise AssertionError("ranks with different sizes were not refused")


def _model_on(group: dist.ProcessGroup) -> torch.nn.Module:
    from torch.distributed.device_mesh import DeviceMesh

    mesh = DeviceMesh.from_group(group, "cpu")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                torch.nn.ReLU(), torch.nn.Linear(256, 10))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def resume(compressor: str) -> None:
    """Saving after 5 steps and resuming in fresh objects trains bit for bit like 10 steps,
    with SGD's momentum and with Adam in the reduce-scatter (the state carries both)."""
    rank, n = init("ddlcomm")
    x, y = synthetic(rank, samples=4096)
    for options in ({"momentum": 0.9}, {"adam_betas": (0.9, 0.999)}):
        _resume(compressor, options, x, y)


def _resume(compressor: str, options: dict, x: torch.Tensor, y: torch.Tensor) -> None:
    def make():
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.05 if "momentum" in options else 0.002, weight_decay=0.01)
        state = fsdp.compress_gradients(model, COMPRESSORS[compressor](), start_compress_iter=2,
                                        min_compression_bytes=0, **options)
        return model, opt, state

    model, opt, state = make()
    _steps(model, opt, x, y, 0, 10)
    straight = torch.cat([p.full_tensor().flatten() for p in model.parameters()])

    model, opt, state = make()
    _steps(model, opt, x, y, 0, 5)
    model_sd, opt_sd = get_state_dict(model, opt)
    saved = {"model": {k: v.clone() for k, v in model_sd.items()}, "opt": opt_sd, "compression": state.state_dict()}
    torch.manual_seed(123)  # a fresh start must not matter
    model, opt, state = make()
    set_state_dict(model, opt, model_state_dict=saved["model"], optim_state_dict=saved["opt"])
    state.load_state_dict(saved["compression"])
    _steps(model, opt, x, y, 5, 10)
    resumed = torch.cat([p.full_tensor().flatten() for p in model.parameters()])
    assert torch.equal(straight, resumed), (options, (straight - resumed).abs().max())
    model, opt, state = make()  # the control: without the compression state it differs
    set_state_dict(model, opt, model_state_dict=saved["model"], optim_state_dict=saved["opt"])
    _steps(model, opt, x, y, 5, 10)
    assert not torch.equal(straight, torch.cat([p.full_tensor().flatten() for p in model.parameters()])), options

    other = fsdp.FSDPCompressionState(compressors.Ternary() if compressor != "ternary" else compressors.OneBit())
    try:
        other.load_state_dict(saved["compression"])
    except ValueError as e:
        assert "saved with" in str(e), e
    else:
        raise AssertionError("a state of another compressor was loaded")


def hsdp() -> None:
    """HSDP on 4 ranks (2 replicas of 2 shards): sharded with fully_shard over the shard
    group, shards averaged over replicas by the compressed all-reduce. Replicas hold the same
    parameters bitwise, and accuracy matches uncompressed HSDP."""
    from torch.distributed.device_mesh import init_device_mesh

    rank, n = init("ddlcomm")
    logging.getLogger("ddlcomm").setLevel(logging.ERROR)
    mesh = init_device_mesh("cpu", (2, n // 2), mesh_dim_names=("replicate", "shard"))
    moments.momentum_math(mesh["shard"].get_group(), mesh["replicate"].get_group())
    moments.adam_math(mesh["shard"].get_group(), mesh["replicate"].get_group())
    moments.non_finite_averages(mesh["shard"].get_group(), mesh["replicate"].get_group())
    moments.on_the_device(mesh["shard"].get_group(), mesh["replicate"].get_group())
    x, y = synthetic(rank, samples=4096)
    results = {}
    for name in (None, "ternary"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                    torch.nn.ReLU(), torch.nn.Linear(256, 10))
        shard_on = mesh if name is None else mesh["shard"]  # plain: torch's own HSDP
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=shard_on)
        fully_shard(model, mesh=shard_on)
        opt = _optimizer("sgd", model)
        if name is not None:
            state = fsdp.compress_gradients(model, COMPRESSORS[name](), start_compress_iter=2, min_compression_bytes=0,
                                            replicate_group=mesh["replicate"].get_group())
        _steps(model, opt, x, y, 0, 120)
        if name is not None:
            assert state.stats.compressed_buckets > 0 and state.replica_residuals, name
        local = torch.cat([p.to_local().flatten() for p in model.parameters()])
        replicas = [torch.empty_like(local) for _ in range(2)]
        dist.all_gather(replicas, local, group=mesh["replicate"].get_group())
        assert torch.equal(replicas[0], replicas[1]), f"{name}: replicas differ"
        results[str(name)] = _accuracy(model)
    if rank == 0:
        print("ACCURACY " + json.dumps(results), flush=True)
    for name, acc in results.items():
        assert acc >= results["None"] - 0.03, f"{name}: {acc:.3f}, plain HSDP {results['None']:.3f}"


def quantized_all_gather(backend: str) -> None:
    """The 8-bit parameter all-gather against all_gather_into_tensor: within half a
    quantization step (max |block| / 254) of every element, bitwise the same on every rank
    (own shard included), 1/4 of the bytes; other dtypes and small shards go unquantized.
    Then (ddlcomm group) FSDP2 training with it and the 1-bit reduce-scatter keeps plain
    FSDP2's accuracy."""
    rank, n = init(backend)
    logging.getLogger("ddlcomm").setLevel(logging.ERROR)
    block, m = 64, 1000
    state = fsdp.AllGatherQuantization(block_size=block, min_bytes=0)
    g = torch.Generator().manual_seed(rank)
    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.randn(m, generator=g) * torch.logspace(-3, 1, m)).to(dtype)  # blocks of very different scales
        out, ref = torch.empty(n * m, dtype=dtype), torch.empty(n * m, dtype=dtype)
        out[rank * m:(rank + 1) * m] = x  # FSDP2's input is a view of the output; here a copy of it
        state.all_gather(out, out[rank * m:(rank + 1) * m], dist.group.WORLD)
        dist.all_gather_into_tensor(ref, x)
        padded = torch.nn.functional.pad(ref.float().view(n, m), (0, -m % block)).view(n, -1, block)
        bound = padded.abs().amax(-1, keepdim=True) / 254 * (1 + 1e-5)
        bound = bound.expand_as(padded).reshape(n, -1)[:, :m].reshape(-1)
        if dtype == torch.bfloat16:  # the decoded value is rounded to bfloat16 too
            bound = bound + ref.float().abs() * 2 ** -8
        err = (out.float() - ref.float()).abs()
        assert (err <= bound).all(), (dtype, (err - bound).max())
        assert err.max() > 0, "nothing was quantized"
        outs = [torch.empty_like(out) for _ in range(n)]
        dist.all_gather(outs, out)
        assert all(torch.equal(o, outs[0]) for o in outs), f"{dtype}: ranks decoded differently"
    sent = state.stats.compressed_bytes_sent / state.stats.compressed_bytes_uncompressed
    assert state.stats.compressed_buckets == 2 and sent < 0.55, vars(state.stats)  # bfloat16: about 1/2
    ints = torch.arange(n * 8, dtype=torch.int64)
    mine = ints[rank * 8:(rank + 1) * 8].clone()
    ints.zero_()
    state.all_gather(ints, mine, dist.group.WORLD)  # mixed-dtype FSDP2 groups gather bytes: not quantized
    assert torch.equal(ints, torch.arange(n * 8)), ints
    big = fsdp.AllGatherQuantization(min_bytes=1 << 20)
    small = torch.randn(n * 10)
    big.all_gather(small, small[rank * 10:(rank + 1) * 10].clone(), dist.group.WORLD)
    assert big.stats.uncompressed_buckets == 1 and big.stats.compressed_buckets == 0
    if backend != "ddlcomm":  # the training below does not depend on the group's backend
        return

    x, y = synthetic(rank, samples=4096)
    results = {}
    for name in ("plain", "8-bit", "8-bit + 1-bit"):
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.0 if name == "8-bit + 1-bit" else 0.9)
        if name != "plain":
            quant = fsdp.quantize_all_gather(model, min_bytes=0)
        if name == "8-bit + 1-bit":
            fsdp.compress_gradients(model, compressors.OneBit(), start_compress_iter=2, min_compression_bytes=0,
                                    momentum=0.9)
        _steps(model, opt, x, y, 0, 120)
        if name != "plain":
            assert quant.stats.compressed_buckets > 0 and quant.stats.compression_ratio > 3.5, vars(quant.stats)
        results[name] = _accuracy(model)
    if rank == 0:
        print("ACCURACY " + json.dumps(results), flush=True)
    for name, acc in results.items():
        assert acc >= results["plain"] - 0.03, f"{name}: {acc:.3f}, plain FSDP2 {results['plain']:.3f}"


if __name__ == "__main__":
    run()
