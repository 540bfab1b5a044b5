"""CUDA scenarios, run on every rank by tests/test_gpu.py: on ddlcomm and gloo groups two ranks
share GPU 0; on nccl groups each rank has its own GPU (world size 1 on a one-GPU machine).

Every CUDA result is checked against the same call on CPU tensors: on the same group, or on
nccl groups on the gloo half of a "cpu:gloo,cuda:nccl" world."""

from __future__ import annotations

import json
import logging
from typing import Optional

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

from common import OPS, init, make_input, op_valid, run
from compression import COMPRESSORS, synthetic
from ddlcomm import hooks, optim
from ddlcomm import fsdp as ddlcomm_fsdp
from ddlcomm.compressed import compressed_all_reduce, server_residual_numel
from ddlcomm.diloco import DiLoCo

GPU = torch.device("cuda", 0)
CPU = torch.device("cpu")


def _init_on_gpu(backend: str) -> tuple[int, int, torch.device]:
    """The default group for `backend` ("nccl": CPU tensors over gloo, CUDA ones over NCCL, so
    one group serves both runs) and this rank's GPU (its own with nccl, else GPU 0)."""
    rank, n = init("cpu:gloo,cuda:nccl" if backend == "nccl" else backend)
    gpu = torch.device("cuda", rank if backend == "nccl" else 0)
    torch.cuda.set_device(gpu)
    logging.getLogger("ddlcomm").setLevel(logging.ERROR)
    return rank, n, gpu


def _same_everywhere(t: torch.Tensor, what: str, group=None) -> None:
    everyone = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, t, group=group)
    assert all(torch.equal(e, t) for e in everyone), f"{what}: ranks differ"


def collectives() -> None:
    """The backend with CUDA tensors: each collective equals its CPU run, bitwise."""
    rank, n = init("ddlcomm")
    torch.cuda.set_device(GPU)
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.uint8):
        for op in ("SUM", "AVG", "MAX", "MIN", "PRODUCT", "BOR"):
            if not op_valid(op, dtype) or (op == "PRODUCT" and dtype == torch.uint8):
                continue
            x = make_input(rank, 4099, dtype, op)
            ref = x.clone()
            dist.all_reduce(ref, OPS[op])
            got = x.to(GPU)
            dist.all_reduce(got, OPS[op])
            assert got.is_cuda and torch.equal(got.cpu(), ref), (dtype, op)
    x = make_input(rank, 1 << 20, torch.float32)

    # Produced and consumed on a side stream, asynchronously, and through a future's callback.
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        big = x.to(GPU) * 2
        work = dist.all_reduce(big, async_op=True)
        work.wait()
        doubled = work.get_future().then(lambda f: f.value()[0] * 2).wait()
        total = big.double().sum().item()
    ref = x * 2
    dist.all_reduce(ref)
    assert total == ref.double().sum().item() and torch.equal(doubled.cpu(), ref * 2)

    # A non-contiguous CUDA tensor, and every other collective DDP and FSDP use.
    cols = x[: 1024 * 64].view(1024, 64).to(GPU).t()
    ref = cols.cpu().contiguous()
    dist.all_reduce(ref)
    dist.all_reduce(cols)
    assert torch.equal(cols.cpu(), ref)
    src = make_input(rank, 1000, torch.float32)
    b = src.to(GPU)
    dist.broadcast(b, src=1)
    rb = src.clone()
    dist.broadcast(rb, src=1)
    assert torch.equal(b.cpu(), rb)
    gathered = torch.empty(n * 1000, device=GPU)
    dist.all_gather_into_tensor(gathered, src.to(GPU))
    rg = torch.empty(n * 1000)
    dist.all_gather_into_tensor(rg, src)
    assert torch.equal(gathered.cpu(), rg)
    listed = [torch.empty(1000, device=GPU) for _ in range(n)]
    dist.all_gather(listed, src.to(GPU))
    assert torch.equal(torch.cat(listed).cpu(), rg)
    full = make_input(rank, 1000 * n, torch.float32)
    part = torch.empty(1000, device=GPU)
    dist.reduce_scatter_tensor(part, full.to(GPU))
    rp = torch.empty(1000)
    dist.reduce_scatter_tensor(rp, full)
    assert torch.equal(part.cpu(), rp)
    a2a = torch.empty(1000 * n, device=GPU)
    dist.all_to_all_single(a2a, full.to(GPU))
    ra = torch.empty(1000 * n)
    dist.all_to_all_single(ra, full)
    assert torch.equal(a2a.cpu(), ra)
    try:
        dist.all_gather_into_tensor(torch.empty(n * 1000), src.to(GPU))
    except (ValueError, RuntimeError) as e:  # torch's own check may come first
        assert "device" in str(e), e
    else:
        raise AssertionError("a CPU output for a CUDA input was accepted")


def compressed(backend: str) -> None:
    """compressed_all_reduce of CUDA tensors equals its CPU run bitwise (result and both
    residuals), for every compressor and input dtype, identically on every rank."""
    rank, n, gpu = _init_on_gpu(backend)
    g = torch.Generator().manual_seed(rank)
    numel = 300_001
    for name, make in COMPRESSORS.items():
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(numel, generator=g).to(dtype)
            worker = torch.randn(numel, generator=g) * 0.01
            server = torch.randn(server_residual_numel(numel, rank, n), generator=g) * 0.01
            on_cpu = [x.clone(), worker.clone(), server.clone()]
            on_gpu = [t.to(gpu) for t in (x, worker, server)]
            compressed_all_reduce(on_cpu[0], make(), on_cpu[1], on_cpu[2], stream=11).wait()
            compressed_all_reduce(on_gpu[0], make(), on_gpu[1], on_gpu[2], stream=11).wait()
            for what, c, d in zip(("result", "worker residual", "server residual"), on_cpu, on_gpu):
                assert torch.equal(d.cpu(), c), f"{name} {dtype}: {what} differs from the CPU run"
            _same_everywhere(on_cpu[0], name)


def _train(device: torch.device, name: str, opt_name: str, steps: int) -> float:
    """Accuracy on held-out data after `steps` of DDP with the `name` hook (None: plain DDP)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                torch.nn.ReLU(), torch.nn.Linear(256, 10)).to(device)
    if opt_name == "sgd":
        opt = optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    else:
        opt = optim.AdamW(model.parameters(), lr=2e-3, weight_decay=1e-2)
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.25)
    state = None
    if name is not None:
        state = hooks.CompressionState(None, COMPRESSORS[name](), start_compress_iter=2, min_compression_bytes=0,
                                       optimizer=opt, model=model)
        ddp.register_comm_hook(state, hooks.compressed_hook)
    accuracy = _fit(device, ddp, model, opt, steps)
    if state is not None:
        assert state.stats.compressed_buckets > 0, name
        assert all(r.device == device for r in state.memory.worker_residuals.values()), name
    return accuracy


def _fit(device: torch.device, forward: torch.nn.Module, model: torch.nn.Module, opt: torch.optim.Optimizer,
         steps: int) -> float:
    """`steps` of training on this rank's synthetic batches; the held-out accuracy after them."""
    rank = dist.get_rank()
    x, y = (t.to(device) for t in synthetic(rank, samples=4096))
    for step in range(steps):
        idx = torch.randint(0, len(x), (64,), generator=torch.Generator().manual_seed(step * 97 + rank)).to(device)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(forward(x[idx]), y[idx]).backward()
        opt.step()
    test_x, test_y = (t.to(device) for t in synthetic(100, samples=2048))
    with torch.no_grad():
        return (model(test_x).argmax(1) == test_y).float().mean().item()


def ddp(backend: str) -> None:
    """DDP on a CUDA model with each hook (and with none) reaches its CPU run's accuracy."""
    rank, n, gpu = _init_on_gpu(backend)
    results = {}
    for opt_name in ("sgd", "adamw"):
        for name in (None, "onebit", "ternary", "topk", "topk_approx", "randomk", "fp16", "bf16"):
            results[f"{opt_name}/{name}"] = (_train(CPU, name, opt_name, 300), _train(gpu, name, opt_name, 300))
    if rank == 0:
        print("ACCURACY " + json.dumps(results), flush=True)
    plain = {opt: results[f"{opt}/None"][0] for opt in ("sgd", "adamw")}
    # One rank (nccl on a one-GPU machine) checks the GPU path against the CPU's; the quality
    # margin against uncompressed is for several ranks (one rank's random-k falls 0.036 short).
    _assert_close_to_cpu(results, plain if n > 1 else None)


def _assert_close_to_cpu(results: dict[str, tuple[float, float]], plain: Optional[dict[str, float]]) -> None:
    """Each run's GPU accuracy within 0.03 of its CPU run's and at most 0.03 under uncompressed."""
    for key, (on_cpu, on_gpu) in results.items():
        opt = key.split("/")[0]
        assert abs(on_gpu - on_cpu) <= 0.03, f"{key}: {on_gpu:.3f} on the GPU, {on_cpu:.3f} on the CPU"
        if plain is not None:
            assert on_gpu >= plain[opt] - 0.03, f"{key}: {on_gpu:.3f} on the GPU, uncompressed {plain[opt]:.3f}"


def fsdp_reduce_scatter(backend: str) -> None:
    """FSDP2's compressed reduce-scatter (ddlcomm.fsdp) of CUDA gradients equals its CPU run
    bitwise, output and residual, for every compressor, dtype and op, over two calls (the
    residual carries over): one C++ implementation on both devices, the kernels differing."""
    rank, n, gpu = _init_on_gpu(backend)
    world = dist.group.WORLD
    g = torch.Generator().manual_seed(rank)
    m = 70_001
    for name, make in COMPRESSORS.items():
        for dtype in (torch.float32, torch.bfloat16):
            for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
                states = {d: ddlcomm_fsdp.FSDPCompressionState(make(), start_compress_iter=0, min_compression_bytes=0)
                          for d in (CPU, gpu)}
                for call in range(2):
                    x = (torch.randn(n * m, generator=g) * (call + 1)).to(dtype)
                    outs = {}
                    for d, state in states.items():
                        outs[d] = torch.empty(m, dtype=dtype, device=d)
                        state.reduce_scatter("layer", outs[d], x.to(d), world, op)
                    what = f"{name} {dtype} {op} call {call}"
                    assert outs[gpu].device == gpu and torch.equal(outs[gpu].cpu(), outs[CPU]), f"{what}: output differs"
                    assert torch.equal(states[gpu].residuals["layer"].cpu(), states[CPU].residuals["layer"]), \
                        f"{what}: residual differs"
                assert states[gpu].stats.compressed_buckets == 2, vars(states[gpu].stats)


def fsdp_moments(backend: str) -> None:
    """``momentum=`` and ``adam_betas=`` on CUDA gradients: outputs and moments close to the CPU
    run's (torch's own arithmetic may round differently on the two devices), a NaN on one rank
    handled alike (every output NaN, the moments kept), and over NCCL no host synchronization
    past a module's first call (its agreement check)."""
    rank, n, gpu = _init_on_gpu(backend)
    world = dist.group.WORLD
    g = torch.Generator().manual_seed(rank)
    m = 70_001
    for name in ("onebit", "ternary", "fp16"):
        for options in ({"momentum": 0.9}, {"adam_betas": (0.9, 0.95)}):
            states = {d: ddlcomm_fsdp.FSDPCompressionState(COMPRESSORS[name](), start_compress_iter=1,
                                                           min_compression_bytes=0, **options) for d in (CPU, gpu)}
            moments = "exp_avgs" if "adam_betas" in options else "momenta"
            for call in range(4):
                x = torch.randn(n * m, generator=g)
                if call == 2 and rank == n - 1:
                    x[(n - 1) * m + 3] = float("nan")
                outs = {}
                for d, state in states.items():
                    outs[d], here = torch.empty(m, device=d), x.to(d)
                    if d == gpu and backend == "nccl" and call > 1:
                        torch.cuda.set_sync_debug_mode("error")  # a host synchronization raises
                    try:
                        state.reduce_scatter("layer", outs[d], here, world, dist.ReduceOp.AVG)
                    finally:
                        torch.cuda.set_sync_debug_mode("default")
                what = f"{name} {options} call {call}"
                assert torch.allclose(outs[gpu].cpu(), outs[CPU], rtol=1e-4, atol=1e-5, equal_nan=True), what
                assert outs[gpu].isnan().all() == (call == 2), f"{what}: NaN where the CPU has none, or none"
                ours, theirs = (getattr(states[d], moments)["layer"] for d in (gpu, CPU))
                assert torch.allclose(ours.cpu(), theirs, rtol=1e-4, atol=1e-5), f"{what}: moments differ"


def _fsdp_model(device: torch.device) -> torch.nn.Module:
    """The DDP test's MLP under FSDP2 (each Linear its own unit) on `device`, same init everywhere."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                torch.nn.ReLU(), torch.nn.Linear(256, 10)).to(device)
    mesh = DeviceMesh.from_group(dist.group.WORLD, device.type)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _train_fsdp(device: torch.device, name: str, options: dict, steps: int) -> float:
    """Held-out accuracy after `steps` of FSDP2 with compress_gradients (name None: plain)."""
    model = _fsdp_model(device)
    if "adam_betas" in options and name is None:
        opt = torch.optim.AdamW(model.parameters(), lr=2e-3, betas=options["adam_betas"], weight_decay=1e-2)
    elif "adam_betas" in options:  # AdamW's step comes from the reduce-scatter
        opt = torch.optim.SGD(model.parameters(), lr=2e-3, weight_decay=1e-2)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9 - options.get("momentum", 0.0))
    state = None
    if name is not None:
        state = ddlcomm_fsdp.compress_gradients(model, COMPRESSORS[name](), start_compress_iter=2,
                                                min_compression_bytes=0, **options)
    accuracy = _fit(device, model, model, opt, steps)
    if state is not None:
        assert state.stats.compressed_buckets > 0, name
        assert all(r.device == device for r in state.residuals.values()), name
    return accuracy


def fsdp_training(backend: str) -> None:
    """FSDP2 on a CUDA model with compressed reduce-scatters (SGD's momentum or Adam in the
    communication; fp16 alone) reaches its CPU run's accuracy, and uncompressed FSDP2's. Needs two
    ranks: on one, FSDP2 reduce-scatters nothing."""
    rank, n, gpu = _init_on_gpu(backend)
    sgd, adam = {"momentum": 0.9}, {"adam_betas": (0.9, 0.95)}  # in the communication, as docs/fsdp.md advises
    runs = {"sgd/None": (None, {}), "sgd/onebit": ("onebit", sgd), "sgd/ternary": ("ternary", sgd),
            "sgd/topk_approx": ("topk_approx", sgd), "sgd/fp16": ("fp16", {}),
            "adamw/None": (None, adam), "adamw/onebit": ("onebit", adam), "adamw/ternary": ("ternary", adam)}
    results = {key: (_train_fsdp(CPU, name, options, 200), _train_fsdp(gpu, name, options, 200))
               for key, (name, options) in runs.items()}
    if rank == 0:
        print("ACCURACY " + json.dumps(results), flush=True)
    plain = {opt: results[f"{opt}/None"][0] for opt in ("sgd", "adamw")}
    _assert_close_to_cpu(results, plain)


def _train_diloco(device: torch.device, name: Optional[str], options: dict, steps: int) -> tuple[float, torch.Tensor]:
    """Held-out accuracy after `steps` of AdamW with DiLoCo outer steps every 10 (name None:
    float32), and the global weights at the end."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                torch.nn.BatchNorm1d(256), torch.nn.ReLU(), torch.nn.Linear(256, 10)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=1e-2)
    diloco = DiLoCo(model, opt, sync_every=10, compressor=COMPRESSORS[name]() if name else None, outer_lr=0.7,
                    outer_momentum=0.5, **options)
    stepped = _OuterSteps(opt, diloco)
    accuracy = _fit(device, model, model, stepped, steps)
    diloco.sync()
    assert diloco.outer_steps > (steps - options.get("warmup_steps", 0)) // 10, (name, options, diloco.outer_steps)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()] +
                     [b.reshape(-1).float() for b in model.buffers()])
    assert flat.device == device
    return accuracy, flat


class _OuterSteps:
    """The inner optimizer as _fit drives it, with DiLoCo.step() after each of its steps."""

    def __init__(self, opt: torch.optim.Optimizer, diloco: DiLoCo) -> None:
        self.opt, self.diloco = opt, diloco

    def zero_grad(self) -> None:
        self.opt.zero_grad()

    def step(self) -> None:
        self.opt.step()
        self.diloco.step()


def diloco(backend: str) -> None:
    """DiLoCo on a CUDA model (float32, 1-bit, ternary, top-k, with 2-bit values; streamed with
    overlap; a warm-up)
    reaches its CPU run's accuracy, and every rank ends with the same weights and buffers."""
    rank, n, gpu = _init_on_gpu(backend)
    runs = {"fp32": (None, {}), "onebit": ("onebit", {}), "ternary": ("ternary", {}),
            "topk_approx": ("topk_approx", {}), "SparseLoCo top-k 2-bit": ("topk_2bit", {}), "ternary streamed": ("ternary", {"fragments": 2, "overlap_steps": 1}),
            "onebit warm-up": ("onebit", {"warmup_steps": 20})}
    results = {}
    for key, (name, options) in runs.items():
        on_cpu, _ = _train_diloco(CPU, name, options, 200)
        on_gpu, weights = _train_diloco(gpu, name, options, 200)
        _same_everywhere(weights, f"DiLoCo {key} on {gpu}")
        results[f"adamw/{key}"] = (on_cpu, on_gpu)
    if rank == 0:
        print("ACCURACY " + json.dumps(results), flush=True)
    _assert_close_to_cpu(results, None)


if __name__ == "__main__":
    run()
