"""The collectives path (csrc/torch/collective_compressed.cc: CUDA tensors', and groups without
CPU collectives') against the engine, run on CPU tensors: the same bits for the compressed
all-reduce and reduce-scatter, flat and over two named hosts. Run by tests/test_hooks.py and
tests/test_fsdp.py."""

from __future__ import annotations

import torch
import torch.distributed as dist

from common import init, run
from compression import COMPRESSORS, assert_paths_agree
from ddlcomm import ProcessGroupDdlcomm, compressed, compressors


def hosts_agree() -> None:
    """2 named hosts x 2 ranks under DDLCOMM_ALLREDUCE_ALGO=hierarchical: the engine's two levels
    on the ddlcomm group and over gloo's send and recv, and the collectives path's (gloo's
    all-reduce inside the host, its all-to-all and all-gather across), give the same bits."""
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
    """The collectives path over a ddlcomm group's own collectives (its alltoall_base,
    _allgather_base and _reduce_scatter_base, as a ddlcomm group's CUDA tensors take them with
    staged payloads) against the engine on the same group: the same bits."""
    rank, n = init()
    for name in ("onebit", "ternary_stochastic", "topk", "bf16"):
        comp = COMPRESSORS[name]()
        outs = []
        for path in ("engine", "collectives"):
            x = torch.randn(70_001, generator=torch.Generator().manual_seed(rank))
            wres = torch.zeros(70_001)
            sres = torch.zeros(compressed.server_residual_numel(70_001, rank, n))
            if path == "engine":
                compressed.compressed_all_reduce(x, comp, wres, sres, stream=3).wait()
            else:
                compressed.all_reduce_over_collectives(x, comp, wres, sres, None, True, 3, True, False)
            outs.append((x, wres, sres))
        for a, b, what in zip(*outs, ("result", "worker residual", "server residual")):
            assert torch.equal(a, b), f"{name}: the collectives path's {what} differs from the engine's"
    m = 1000
    x = torch.randn(n * m, generator=torch.Generator().manual_seed(rank))
    results = []
    for path in ("engine", "collectives"):
        out, res = torch.empty(m), torch.zeros(n * m)
        if path == "engine":
            compressed.engine_of(None).compressed_reduce_scatter(out, x, compressors.OneBit().config, res, True,
                                                                 5).wait()
        else:
            compressed.reduce_scatter_over_collectives(out, x, compressors.OneBit(), res, dist.group.WORLD, True, 5,
                                                       True)
        results.append((out, res))
    assert all(torch.equal(a, b) for a, b in zip(*results)), "reduce-scatter: the paths differ"


def reduce_scatter_agrees(layered: str = "") -> None:
    """The compressed reduce-scatter on the ddlcomm group, over gloo's send and recv (the
    engine) and over gloo's all-to-all (the collectives path): the same output and residual
    bits for every format, dtype and op, over two calls (the residuals carry over). `layered`
    ("hosts"): 2 named hosts x 2 ranks, where all three take two levels."""
    rank, n = init()
    gloo = dist.new_group(backend="gloo")
    assert (compressed.host_levels_of(gloo) is not None) == bool(layered)
    makers = {"onebit": compressors.OneBit, "onebit2": lambda: compressors.OneBit(block_size=64, two_scales=True),
              "ternary": lambda: compressors.Ternary(block_size=64, stochastic=True, seed=3),
              "topk": lambda: compressors.TopK(ratio=0.05), "randomk": lambda: compressors.RandomK(ratio=0.1, seed=5),
              "bf16": compressors.BF16}
    paths = {
        "ddlcomm": lambda out, x, comp, res, average, stream: compressed.engine_of(None).compressed_reduce_scatter(
            out, x, comp.config, res, average, stream).wait(),
        "gloo": lambda out, x, comp, res, average, stream: compressed.engine_of(gloo).compressed_reduce_scatter(
            out, x, comp.config, res, average, stream).wait(),
        "collectives": lambda out, x, comp, res, average, stream: compressed.reduce_scatter_over_collectives(
            out, x, comp, res, gloo, average, stream, True),
    }
    for name, make in makers.items():
        for dtype in (torch.float32, torch.bfloat16):
            for m in (1, 1000, 70_001):
                g = torch.Generator().manual_seed(rank * 1000 + m)
                residual = torch.randn(n * m, generator=g) * 0.1
                results = {path: (torch.empty(m, dtype=dtype), residual.clone()) for path in paths}
                for average, stream in ((True, 7), (False, 8)):
                    x = (torch.randn(n * m, generator=g) * (rank + 1)).to(dtype)
                    for path, reduce_scatter in paths.items():
                        reduce_scatter(results[path][0], x.clone(), make(), results[path][1], average, stream)
                    what = f"{name} {dtype} m={m} average={average}"
                    for path in ("gloo", "collectives"):
                        for a, b, part in zip(results["ddlcomm"], results[path], ("output", "residual")):
                            assert torch.equal(a, b), f"{what}: the {path} path's {part} differs from the ddlcomm group's"


if __name__ == "__main__":
    run()
