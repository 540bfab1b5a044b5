"""The one implementation of the compressed collectives (csrc/torch/collective_compressed.cc) on
CPU tensors: its adapters against each other (a ddlcomm group's executor, a gloo group's, gloo's
own collectives on the caller's thread: the same bits, flat, over pieces and over two named
hosts), which transport a gloo group's engine takes, and the all-reduce and reduce-scatter
against their plan computed in Python. Run by tests/test_hooks.py and tests/test_fsdp.py."""

from __future__ import annotations

import os
import warnings

import torch
import torch.distributed as dist

from common import init, run
from compression import COMPRESSORS
from ddlcomm import ProcessGroupDdlcomm, compressed, compressors
from ddlcomm.compressed import compressed_all_reduce, engine_of, native_backend, server_residual_numel


def _collectives_path(x: torch.Tensor, comp, wres: torch.Tensor | None, sres: torch.Tensor | None, gloo: dist.ProcessGroup,
                      stream: int) -> torch.Tensor:
    """The plan over the group's own collectives, as CUDA tensors and nccl groups take it, on CPU tensors."""
    compressed.all_reduce_over_collectives(x, comp, wres, sres, gloo, True, stream, True, False)
    return x


def assert_paths_agree(name: str, numel: int, gloo: dist.ProcessGroup, stream: int,
                       dtype: torch.dtype = torch.float32, strided: bool = False) -> None:
    """One compressed all-reduce on the ddlcomm group (its executor and transport), one on `gloo`
    (its ddlcomm executor, over gloo's send and recv or shared memory, as DDLCOMM_TRANSPORT says)
    and one over gloo's own collectives on the caller's thread (CUDA tensors' path over NCCL),
    from the same inputs and residuals: the same result and residuals, and the same on every rank.
    `strided`: the tensor is every other element of a larger one (reduced in place all the same)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    comp = COMPRESSORS[name]()
    results = []
    for path in ("ddlcomm", "gloo", "collectives"):
        x = torch.randn(numel * (2 if strided else 1), generator=torch.Generator().manual_seed(rank * 7 + numel))
        x = x.to(dtype)[::2] if strided else x.to(dtype)
        wres = torch.randn(numel, generator=torch.Generator().manual_seed(99 + rank)) * 0.1
        sres = torch.randn(server_residual_numel(numel, rank, n),
                           generator=torch.Generator().manual_seed(55 + rank)) * 0.1
        if path == "collectives":
            out = _collectives_path(x, comp, wres, sres, gloo, stream)
        else:
            out = compressed_all_reduce(x, comp, wres, sres, group=gloo if path == "gloo" else None,
                                        stream=stream).wait()
        results.append((path, (out, wres, sres)))
    (_, first), rest = results[0], results[1:]
    for path, other in rest:
        for a, b, what in zip(first, other, ("result", "worker residual", "server residual")):
            assert torch.equal(a, b), \
                f"{name} {dtype} x{numel}: the ddlcomm group's and the {path} path's {what} differ"
    everyone = [torch.empty_like(first[0]) for _ in range(n)]
    dist.all_gather(everyone, first[0], group=gloo)
    assert all(torch.equal(e, first[0]) for e in everyone), f"{name} x{numel}: ranks hold different results"


def paths_agree() -> None:
    """The ddlcomm group, the gloo group and the collectives path give the same bits, and ddlcomm's
    own calls raise no deprecation warning."""
    warnings.simplefilter("error", FutureWarning)
    warnings.simplefilter("error", DeprecationWarning)
    init()
    gloo = dist.new_group(backend="gloo")
    assert native_backend(None) is not None and native_backend(gloo) is None
    engine = engine_of(gloo)
    assert "over gloo" in repr(engine)
    try:  # it runs the collectives; send and recv go over the group itself
        engine.send([torch.ones(1)], (dist.get_rank() + 1) % dist.get_world_size(), 0)
    except RuntimeError as e:
        assert "use the carrier group itself" in str(e), e
    else:
        raise AssertionError("the gloo group's ddlcomm backend took a send")
    for name in COMPRESSORS:
        # 70_001: several reduce tiles per chunk; 8_400_003: chunks split across threads, for one
        # compressor of each reduction (blocks of scales, 2-bit codes, sparse sums, casts): the
        # variants of one share its threading
        large = (8_400_003,) if name in ("onebit", "ternary", "topk_2bit", "bf16") else ()
        for numel in (1, 5, 1000, 70_001) + large:
            assert_paths_agree(name, numel, gloo, stream=11)


def engine_transport() -> None:
    """Where the engine of a gloo group sends its bytes (ranks on named hosts, two a host): over
    gloo's send and recv for all ranks, which span hosts, and through shared memory for a group
    of one host's ranks (unless DDLCOMM_TRANSPORT=tcp); the same bits either way."""
    rank, n = init()
    shared = os.environ.get("DDLCOMM_TRANSPORT", "auto") != "tcp"
    world = dist.new_group(backend="gloo")
    hosts = [dist.new_group([r, r + 1], backend="gloo") for r in range(0, n, 2)]
    host = hosts[rank // 2]
    comp = compressors.OneBit()
    for group, local in ((world, False), (host, shared)):
        engine = engine_of(group)
        before = engine.stats()
        x = torch.randn(10_000, generator=torch.Generator().manual_seed(rank))
        y = x.clone()
        compressed_all_reduce(x, comp, group=group).wait()
        _collectives_path(y, comp, None, None, group, stream=0)
        assert torch.equal(x, y), f"rank {rank}: the engine and gloo's collectives disagree"
        after = engine.stats()
        moved = after["shared_memory_bytes_sent"] - before["shared_memory_bytes_sent"]
        carried = after["bytes_sent"] - before["bytes_sent"]
        assert after["network"] == "c10d:gloo", after
        assert after["shared_memory_peers"] == (dist.get_world_size(group) - 1 if local else 0), after
        assert (moved > 0, carried > 0) == (local, not local), (local, moved, carried)


def pieces_agree() -> None:
    """A vector longer than one piece (the second one short): the pipeline over its pieces on
    both groups and the collectives path's loop over them give the same bits, on every rank."""
    init()
    gloo = dist.new_group(backend="gloo")
    for name in ("onebit", "ternary", "bf16"):
        assert_paths_agree(name, ProcessGroupDdlcomm.piece_elements + 70_001, gloo, stream=4)


def debug_wrapper() -> None:
    """Under TORCH_DISTRIBUTED_DEBUG=DETAIL torch wraps the backend; the compressed all-reduce
    still finds the native one (and the bits of every other path)."""
    init()
    wrapped = dist.group.WORLD._get_backend(torch.device("cpu"))
    assert not isinstance(wrapped, ProcessGroupDdlcomm), "the debug mode did not wrap the backend: nothing tested"
    assert isinstance(native_backend(None), ProcessGroupDdlcomm)
    assert_paths_agree("onebit", 70_001, dist.new_group(backend="gloo"), stream=3)


def hosts_agree() -> None:
    """2 named hosts x 2 ranks under DDLCOMM_ALLREDUCE_ALGO=hierarchical: the two levels on the
    ddlcomm group, on the gloo group's executor and over gloo's own collectives on the caller's
    thread give the same bits."""
    init()
    gloo = dist.new_group(backend="gloo")
    assert compressed.two_levels(None) and compressed.two_levels(gloo)
    assert compressed.host_levels_of(gloo) is not None
    for name in ("onebit", "ternary_stochastic", "topk", "randomk", "bf16"):
        for numel in (3, 70_001):
            assert_paths_agree(name, numel, gloo, stream=12)
    assert_paths_agree("ternary", ProcessGroupDdlcomm.piece_elements + 70_001, gloo, stream=5)


def dtypes_agree() -> None:
    """float16 and bfloat16 tensors, and a tensor that is a strided view (reduced in place): the
    three paths give the same bits."""
    init()
    gloo = dist.new_group(backend="gloo")
    for dtype in (torch.float16, torch.bfloat16):
        for name in ("onebit", "ternary", "topk", "fp16"):
            for numel in (7, 70_001):
                assert_paths_agree(name, numel, gloo, stream=13, dtype=dtype)
    for name in ("ternary", "topk"):
        assert_paths_agree(name, 1000, gloo, stream=14, strided=True)


def over_ddlcomm_agrees() -> None:
    """A ddlcomm group's collectives (alltoall_base, _allgather_base) called from the caller's
    thread (all_reduce_over_collectives) against the same implementation run as one operation on
    the group's executor (compressed_all_reduce): the same bits."""
    rank, n = init()
    for name in ("onebit", "ternary_stochastic", "topk", "bf16"):
        comp = COMPRESSORS[name]()
        outs = []
        for path in ("executor", "caller"):
            x = torch.randn(70_001, generator=torch.Generator().manual_seed(rank))
            wres = torch.zeros(70_001)
            sres = torch.zeros(compressed.server_residual_numel(70_001, rank, n))
            if path == "executor":
                compressed.compressed_all_reduce(x, comp, wres, sres, stream=3).wait()
            else:
                compressed.all_reduce_over_collectives(x, comp, wres, sres, None, True, 3, True, False)
            outs.append((x, wres, sres))
        for a, b, what in zip(*outs, ("result", "worker residual", "server residual")):
            assert torch.equal(a, b), f"{name}: the caller's thread's {what} differs from the executor's"


def _planned_all_reduce(comp: compressors.Compressor, inputs: list[torch.Tensor], workers: list[torch.Tensor],
                        servers: list[torch.Tensor], stream: int) -> torch.Tensor:
    """The flat compressed all-reduce (average, one piece) computed here from every rank's input,
    written out as the oracle: rank r encodes chunk j of its input (bounds numel * j // n) with
    that chunk of its worker residual and stream encode_stream(stream, r, 0, j, n); rank j sums
    the decoded payloads of chunk j in rank order in float32, times a float32 1/n, re-encodes the
    sum with its server residual and stream encode_stream(stream, j, 1, j, n), and every rank
    decodes that. Sparse formats: every rank's whole-vector payload (stream encode_stream(stream,
    r, 0, 0, n)) summed in rank order, times 1/n. Residuals are updated in place."""
    n, numel = len(inputs), inputs[0].numel()
    encode_stream = ProcessGroupDdlcomm.encode_stream
    scale = torch.tensor(1.0) / n
    if comp.is_sparse:
        acc = torch.zeros(numel)
        for r in range(n):
            comp.decode_accumulate(comp.encode(inputs[r], workers[r], encode_stream(stream, r, 0, 0, n)), acc)
        return acc.mul_(scale)
    bounds = [numel * j // n for j in range(n + 1)]
    out = torch.empty(numel)
    for j in range(n):
        chunk = slice(bounds[j], bounds[j + 1])
        acc = torch.zeros(bounds[j + 1] - bounds[j])
        for r in range(n):
            payload = comp.encode(inputs[r][chunk], workers[r][chunk], encode_stream(stream, r, 0, j, n))
            comp.decode_accumulate(payload, acc)
        reduced = comp.encode(acc.mul_(scale), servers[j], encode_stream(stream, j, 1, j, n))
        comp.decode(reduced, out=out[chunk])
    return out


def all_reduce_is_the_plan() -> None:
    """The compressed all-reduce (one implementation) on a ddlcomm group and on a gloo group:
    the result and both residuals, bit for bit, are those of the plan computed here from every
    rank's input (``_planned_all_reduce``), for quantizers, casts and top-k, over two calls (the
    residuals carry over). The adapters' agreement tests check them against each other; this
    one checks what they all compute."""
    rank, n = init()
    gloo = dist.new_group(backend="gloo")
    groups = {"ddlcomm": dist.group.WORLD, "gloo": gloo}
    numel = 70_001
    for name in ("onebit", "ternary_stochastic", "fp16", "topk"):
        comp = COMPRESSORS[name]()
        workers = [torch.randn(numel, generator=torch.Generator().manual_seed(10 + r)) * 0.1 for r in range(n)]
        servers = [torch.randn(compressed.server_residual_numel(numel, r, n),
                               generator=torch.Generator().manual_seed(20 + r)) * 0.1 for r in range(n)]
        state = {label: (workers[rank].clone(), servers[rank].clone()) for label in groups}
        for call, stream in enumerate((5, 6)):
            inputs = [torch.randn(numel, generator=torch.Generator().manual_seed(100 * call + r)) for r in range(n)]
            results = {}
            for label, group in groups.items():
                x = inputs[rank].clone()
                compressed.compressed_all_reduce(x, comp, *state[label], group=group, stream=stream).wait()
                results[label] = x
            expected = _planned_all_reduce(comp, inputs, workers, servers, stream)
            for label in groups:
                got = (results[label], *state[label])
                for a, b, part in zip(got, (expected, workers[rank], servers[rank]), ("result", "worker residual",
                                                                                  "server residual")):
                    assert torch.equal(a, b), f"{name} call {call}: the {label} group's {part} differs from the plan's"


def _planned_reduce_scatter(comp: compressors.Compressor, inputs: list[torch.Tensor], residuals: list[torch.Tensor],
                            average: bool, stream: int) -> torch.Tensor:
    """The flat compressed reduce-scatter computed here from every rank's input: rank j encodes
    chunk o with that chunk of its residual (``residuals[j]``, updated in place) and stream
    encode_stream(stream, j, 0, o, n, 0); this rank's output is the float32 sum of the decoded
    payloads of its chunk in rank order, times a float32 1/n for an average."""
    rank, n = dist.get_rank(), dist.get_world_size()
    m = inputs[0].numel() // n
    acc = torch.zeros(m)
    for j in range(n):
        for o in range(n):
            chunk = slice(o * m, (o + 1) * m)
            payload = comp.encode(inputs[j][chunk], residuals[j][chunk],
                                  ProcessGroupDdlcomm.encode_stream(stream, j, 0, o, n, 0))
            if o == rank:
                comp.decode_accumulate(payload, acc)
    if average:
        acc.mul_(torch.tensor(1.0) / n)
    return acc.to(inputs[0].dtype)


def reduce_scatter_agrees(layered: str = "") -> None:
    """The compressed reduce-scatter (ddlcomm.fsdp's; one C++ implementation over the group's
    collectives) on the ddlcomm group and on a gloo group: flat, the output and residual bits
    the plan gives when computed here from every rank's input (``_planned_reduce_scatter``);
    over 2 named hosts x 2 ranks (`layered`: "hosts"), where both take two levels, the same bits
    on both groups. For every format, dtype and op, over two calls (the residuals carry over)."""
    rank, n = init()
    gloo = dist.new_group(backend="gloo")
    assert (compressed.host_levels_of(gloo) is not None) == bool(layered)
    assert (compressed.host_levels_of(dist.group.WORLD) is not None) == bool(layered)
    makers = {"onebit": compressors.OneBit, "onebit2": lambda: compressors.OneBit(block_size=64, two_scales=True),
              "ternary": lambda: compressors.Ternary(block_size=64, stochastic=True, seed=3),
              "topk": lambda: compressors.TopK(ratio=0.05), "randomk": lambda: compressors.RandomK(ratio=0.1, seed=5),
              "bf16": compressors.BF16}
    groups = {"ddlcomm": dist.group.WORLD, "gloo": gloo}
    for name, make in makers.items():
        for dtype in (torch.float32, torch.bfloat16):
            for m in (1, 1000, 70_001):
                def seeded(j: int, what: int) -> torch.Generator:
                    return torch.Generator().manual_seed(j * 1000 + m * 10 + what)
                residuals = [torch.randn(n * m, generator=seeded(j, 0)) * 0.1 for j in range(n)]
                results = {group: (torch.empty(m, dtype=dtype), residuals[rank].clone()) for group in groups}
                for call, (average, stream) in enumerate(((True, 7), (False, 8))):
                    inputs = [(torch.randn(n * m, generator=seeded(j, 1 + call)) * (j + 1)).to(dtype) for j in range(n)]
                    for label, group in groups.items():
                        out, residual = results[label]
                        compressed.compressed_reduce_scatter(out, inputs[rank].clone(), make(), residual, group,
                                                             average, stream, verify=True)
                    what = f"{name} {dtype} m={m} average={average}"
                    if layered:
                        for a, b, part in zip(results["ddlcomm"], results["gloo"], ("output", "residual")):
                            assert torch.equal(a, b), f"{what}: the gloo group's {part} differs from the ddlcomm group's"
                        continue
                    expected = _planned_reduce_scatter(make(), inputs, residuals, average, stream)
                    for label in groups:
                        for a, b, part in zip(results[label], (expected, residuals[rank]), ("output", "residual")):
                            assert torch.equal(a, b), f"{what}: the {label} group's {part} differs from the plan's"


if __name__ == "__main__":
    run()
