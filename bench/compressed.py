"""Compressed all-reduce and DDP hooks, timed on whatever network the ranks run on.

Launched once per rank (env:// rendezvous), normally by ``bench.slownet.run_compressed``
inside emulated hosts. Rank 0 prints one JSON line per measurement (prefix ``RESULT``).

(a) all-reduce of a 100 MB float32 gradient: gloo fp32, ddlcomm fp32 (hierarchical where the
    ranks are on several hosts with several ranks each, and then the flat ring as well), and the
    compressed all-reduce with fp16, 1-bit, ternary and top-k 1%;
(b) ddlcomm.fsdp's compressed reduce-scatter of the same gradient: native (hierarchical where
    the all-reduce is, and then the flat one as well), and on the gloo group, against gloo's and
    ddlcomm's fp32 ones (hierarchical and flat likewise); the
    float32 all-gather of its shards, gloo's and ddlcomm's (hierarchical and flat likewise);
(c) DDP training of a >= 25M-parameter model: seconds per iteration with gloo (default
    hook), PyTorch's fp16_compress_hook and powerSGD_hook (rank 4), each ddlcomm hook (bf16
    as well), and the adaptive fp16 and 1-bit hooks (exact, bf16 or the compressor, whichever
    was measured fastest: timed after their choice), with the bytes each rank puts on the wire
    per iteration;
(d) with --over-gloo-only, the compressed all-reduce (1-bit, ternary) on the gloo group: in two
    levels with DDLCOMM_ALLREDUCE_ALGO=hierarchical where its ranks' hosts take them, else flat.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

import ddlcomm
from ddlcomm import compressors, fsdp, hooks
from ddlcomm.compressed import (compressed_all_reduce, engine_of, host_levels_of, reduce_scatter_wire_bytes,
                                server_residual_numel, two_levels, wire_bytes)
from ddlcomm.wire import ring_all_reduce_bytes, ring_reduce_scatter_bytes

from bench import init_ranks

COMPRESSORS = {
    "fp16": compressors.FP16,
    "1-bit": compressors.OneBit,
    "ternary": compressors.Ternary,
    "top-k 1%": lambda: compressors.TopK(ratio=0.01, approximate=True),
}


def report(**fields) -> None:
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(fields), flush=True)


def timed(call, repeats: int) -> float:
    call()  # warm-up (connections, residual allocation, page faults)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(repeats):
        call()
    elapsed = torch.tensor([(time.perf_counter() - start) / repeats])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed.item())


def allreduce_bench(gloo, numel: int, repeats: int, compressed: bool = True) -> None:
    rank, n = dist.get_rank(), dist.get_world_size()
    grad = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
    fp32_bytes = ring_all_reduce_bytes(numel * 4, n)
    base = timed(lambda: dist.all_reduce(grad, group=gloo), repeats)
    report(kind="allreduce", method="gloo fp32", seconds=base, speedup=1.0, wire_bytes=fp32_bytes, numel=numel, ranks=n)
    world = dist.group.WORLD._get_backend(torch.device("cpu"))
    before = world.stats()["hierarchical_allreduces"]
    t = timed(lambda: dist.all_reduce(grad), repeats)
    groups = [(None, "")]
    if world.stats()["hierarchical_allreduces"] == before:
        report(kind="allreduce", method="ddlcomm fp32", seconds=t, speedup=base / t, wire_bytes=fp32_bytes)
    else:  # bytes differ by link (inside a host or across): none stated
        report(kind="allreduce", method=f"ddlcomm fp32 hierarchical ({world.stats()['topology']})", seconds=t,
               speedup=base / t, wire_bytes=None)
        flat = dist.new_group(backend="ddlcomm", pg_options=ddlcomm.Options(allreduce_algorithm="ring"))
        t = timed(lambda: dist.all_reduce(grad, group=flat), repeats)
        report(kind="allreduce", method="ddlcomm fp32 flat ring", seconds=t, speedup=base / t, wire_bytes=fp32_bytes)
        groups.append((flat, " flat"))
    if not compressed:
        return
    for group, flat_name in groups:
        for name, make in COMPRESSORS.items():
            comp = make()
            wres = torch.zeros(numel)
            sres = torch.zeros(server_residual_numel(numel, rank, n))
            # Each call reduces its own copy of the gradient, made and freed outside the clock:
            # gloo and ddlcomm fp32 above reduce a buffer that already exists, as DDP does its
            # buckets. (A clone inside the call would time a 100 MB allocation and its page faults
            # as well.)
            copies = [grad.clone() for _ in range(repeats + 1)]
            step = iter(range(len(copies)))

            def call():
                i = next(step)
                compressed_all_reduce(copies[i], comp, wres, sres, group=group, stream=i).wait()

            before = world.stats()["hierarchical_compressed_allreduces"]
            t = timed(call, repeats)
            hierarchical = world.stats()["hierarchical_compressed_allreduces"] > before
            # The hierarchy's bytes differ by link, as above.
            report(kind="allreduce", method=f"ddlcomm {name}{' hierarchical' if hierarchical else flat_name}",
                   seconds=t, speedup=base / t, wire_bytes=None if hierarchical else wire_bytes(comp, numel, n))


def over_gloo_bench(gloo, numel: int, repeats: int) -> None:
    """The compressed all-reduce on the gloo group (the ddlcomm group's C++ over gloo's send and
    recv): in two levels under DDLCOMM_ALLREDUCE_ALGO=hierarchical where its hosts take them, else
    flat; against gloo's fp32 all-reduce."""
    rank, n = dist.get_rank(), dist.get_world_size()
    grad = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
    base = timed(lambda: dist.all_reduce(grad, group=gloo), repeats)
    report(kind="allreduce", method="gloo fp32", seconds=base, speedup=1.0,
           wire_bytes=ring_all_reduce_bytes(numel * 4, n), numel=numel, ranks=n)
    layered = two_levels(gloo)
    plan = f"two levels, {engine_of(gloo).stats()['topology']}" if layered else "flat"
    for name in ("1-bit", "ternary"):
        comp = COMPRESSORS[name]()
        wres, sres = torch.zeros(numel), torch.zeros(server_residual_numel(numel, rank, n))
        copies = [grad.clone() for _ in range(repeats + 1)]  # made outside the clock, as above
        step = iter(range(len(copies)))
        t = timed(lambda: compressed_all_reduce(copies[next(step)], comp, wres, sres, group=gloo).wait(), repeats)
        report(kind="allreduce", method=f"{name} over gloo ({plan})", seconds=t, speedup=base / t,
               wire_bytes=None if layered else wire_bytes(comp, numel, n))


def reduce_scatter_bench(gloo, numel: int, repeats: int) -> None:
    """(b) ddlcomm.fsdp's compressed reduce-scatter of a `numel`-element float32 gradient on the
    ddlcomm group and on the gloo group (the same C++ collective over each group's all-to-all),
    and the plain fp32 reduce-scatters."""
    rank, n = dist.get_rank(), dist.get_world_size()
    m = numel // n
    grad = torch.randn(n * m, generator=torch.Generator().manual_seed(rank))
    out = torch.empty(m)
    fp32_bytes = ring_reduce_scatter_bytes(n * m * 4, n)
    base = timed(lambda: dist.reduce_scatter_tensor(out, grad, group=gloo), repeats)
    report(kind="reduce_scatter", method="gloo fp32", seconds=base, speedup=1.0, wire_bytes=fp32_bytes)
    world = dist.group.WORLD._get_backend(torch.device("cpu"))
    flat = None  # made where the native ones take two levels (exact inside hosts), to time both
    before = world.stats()["hierarchical_reduce_scatters"]
    t = timed(lambda: dist.reduce_scatter_tensor(out, grad), repeats)
    if world.stats()["hierarchical_reduce_scatters"] == before:
        report(kind="reduce_scatter", method="ddlcomm fp32", seconds=t, speedup=base / t, wire_bytes=fp32_bytes)
    else:  # bytes differ by link: none stated
        report(kind="reduce_scatter", method="ddlcomm fp32 hierarchical", seconds=t, speedup=base / t, wire_bytes=None)
        flat = dist.new_group(backend="ddlcomm", pg_options=ddlcomm.Options(allreduce_algorithm="ring"))
        t = timed(lambda: dist.reduce_scatter_tensor(out, grad, group=flat), repeats)
        report(kind="reduce_scatter", method="ddlcomm fp32 flat ring", seconds=t, speedup=base / t,
               wire_bytes=fp32_bytes)
    for name in ("1-bit", "ternary"):
        comp = COMPRESSORS[name]()
        wire = reduce_scatter_wire_bytes(comp, m, n)
        # The same C++ collective on both groups, over each one's all-to-all.
        paths = [("native", dist.group.WORLD), ("over gloo", gloo)]
        while paths:
            label, group = paths.pop(0)
            state = fsdp.FSDPCompressionState(comp, start_compress_iter=0, min_compression_bytes=0)
            state.reduce_scatter("g", out, grad, group, dist.ReduceOp.AVG)  # residual allocated, agreement checked
            call = lambda: state.reduce_scatter("g", out, grad, group, dist.ReduceOp.AVG)  # noqa: E731
            t = timed(call, repeats)
            if host_levels_of(group) is not None:
                # The hierarchy's bytes differ by link: none stated.
                report(kind="reduce_scatter", method=f"{name} native hierarchical", seconds=t, speedup=base / t,
                       wire_bytes=None)
                if flat is None:
                    flat = dist.new_group(backend="ddlcomm", pg_options=ddlcomm.Options(allreduce_algorithm="ring"))
                paths.insert(0, ("native flat", flat))
                continue
            report(kind="reduce_scatter", method=f"{name} {label}", seconds=t, speedup=base / t, wire_bytes=wire)


def all_gather_bench(gloo, numel: int, repeats: int) -> None:
    """(b) FSDP's parameter all-gather of a `numel`-element float32 vector: gloo's, and ddlcomm's
    (hierarchical where its hosts take it, and then the flat ring as well)."""
    n = dist.get_world_size()
    m = numel // n
    shard = torch.randn(m, generator=torch.Generator().manual_seed(dist.get_rank()))
    out = torch.empty(n * m)
    fp32_bytes = (n - 1) * m * 4
    base = timed(lambda: dist.all_gather_into_tensor(out, shard, group=gloo), repeats)
    report(kind="all_gather", method="gloo fp32", seconds=base, speedup=1.0, wire_bytes=fp32_bytes)
    world = dist.group.WORLD._get_backend(torch.device("cpu"))
    before = world.stats()["hierarchical_allgathers"]
    t = timed(lambda: dist.all_gather_into_tensor(out, shard), repeats)
    if world.stats()["hierarchical_allgathers"] == before:
        report(kind="all_gather", method="ddlcomm fp32", seconds=t, speedup=base / t, wire_bytes=fp32_bytes)
        return
    report(kind="all_gather", method="ddlcomm fp32 hierarchical", seconds=t, speedup=base / t, wire_bytes=None)
    flat = dist.new_group(backend="ddlcomm", pg_options=ddlcomm.Options(allreduce_algorithm="ring"))
    t = timed(lambda: dist.all_gather_into_tensor(out, shard, group=flat), repeats)
    report(kind="all_gather", method="ddlcomm fp32 flat ring", seconds=t, speedup=base / t, wire_bytes=fp32_bytes)


def make_model(width: int, depth: int) -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    layers.append(torch.nn.Linear(width, 10))
    return torch.nn.Sequential(*layers)


def ddp_bench(gloo, width: int, depth: int, iters: int, batch: int, only: Optional[list[str]] = None) -> None:
    rank, n = dist.get_rank(), dist.get_world_size()
    params = sum(p.numel() for p in make_model(width, depth).parameters())
    x = torch.randn(batch, width, generator=torch.Generator().manual_seed(rank))
    y = torch.randint(0, 10, (batch,), generator=torch.Generator().manual_seed(rank))
    grad_bytes = params * 4
    fp32_wire = ring_all_reduce_bytes(grad_bytes, n)

    # PyTorch's PowerSGD hook runs over the ddlcomm group: over gloo (shared or a fresh
    # group) gloo aborted here with "Received data size doesn't match expected size".
    psgd_group = None
    configs = [("gloo default", gloo, None, None), ("gloo fp16_compress_hook", gloo, None, default_hooks.fp16_compress_hook),
               ("torch powerSGD rank 4 (ddlcomm)", psgd_group, powerSGD_hook.PowerSGDState(psgd_group, matrix_approximation_rank=4,
                                                                           start_powerSGD_iter=2, min_compression_rate=2,
                                                                           use_error_feedback=True, warm_start=True),
                powerSGD_hook.powerSGD_hook),
               ("ddlcomm default", None, None, None)]
    for name, make in [*COMPRESSORS.items(), ("bf16", compressors.BF16)]:
        state = hooks.CompressionState(None, make(), start_compress_iter=2)
        configs.append((f"ddlcomm {name} hook", None, state, hooks.compressed_hook))
    for name, make in (("fp16", compressors.FP16), ("1-bit", compressors.OneBit)):
        state = hooks.CompressionState(None, make(), start_compress_iter=2, adaptive=True)
        configs.append((f"ddlcomm adaptive {name} hook", None, state, hooks.compressed_hook))
    # The fixed hooks in one level where the world takes two (a group with allreduce_algorithm="ring"):
    # only when asked for, as new_group connects every rank.
    one_level = {f"ddlcomm {name} hook (one level)": name for name in ("1-bit", "ternary")}
    for label, name in one_level.items():
        if only and label in only:
            ring = dist.new_group(backend="ddlcomm", pg_options=ddlcomm.Options(allreduce_algorithm="ring"))
            state = hooks.CompressionState(ring, COMPRESSORS[name](), start_compress_iter=2)
            configs.append((label, ring, state, hooks.compressed_hook))
    if only:
        methods = [label for label, *_ in configs if label not in one_level] + list(one_level)
        unknown = sorted(set(only) - set(methods))
        if unknown:
            raise SystemExit(f"--ddp-methods: no method {unknown}; the methods: {methods}")
        configs = [config for config in configs if config[0] in only]
    base = None
    for label, group, state, hook in configs:
        model = make_model(width, depth)
        ddp = DistributedDataParallel(model, process_group=group)
        if hook is not None:
            ddp.register_comm_hook(state, hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)

        def step():
            opt.zero_grad()
            torch.nn.functional.cross_entropy(ddp(x), y).backward()
            opt.step()

        # Past every hook's warm-up, alike for all (a step still in a hook's warm-up sends
        # uncompressed and would be timed as the hook's), and past the adaptive hook's measurement (up to 2 + 34 iterations with the one-level option and a plan per bucket).
        for _ in range(24):
            step()
        while getattr(state, "tuner", None) is not None and not state.tuner.settled(state.iter):
            step()
        seconds = timed(step, iters)
        base = base or seconds
        if isinstance(state, hooks.CompressionState):
            before = state.stats.bytes_sent
            step()
            wire = state.stats.bytes_sent - before
        elif "fp16" in label:
            wire = fp32_wire // 2
        elif "powerSGD" in label:
            wire = None  # low-rank factors; depends on layer shapes (reported as n/a)
        else:
            wire = fp32_wire
        tuner = getattr(state, "tuner", None)
        chose = {} if tuner is None else {"choice": tuner.name(tuner.choice), "measured": tuner.measured,
                                          "plan": [tuner.name(o) for o in tuner.buckets]}
        report(kind="ddp", method=label, seconds=seconds, speedup=base / seconds, wire_bytes=wire, params=params,
               **chose)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--numel", type=int, default=25_000_000, help="elements of the all-reduce (100 MB fp32)")
    parser.add_argument("--repeats", type=int, default=3, help="timed all-reduces per method (the median is reported)")
    parser.add_argument("--width", type=int, default=2048, help="hidden width of the DDP model")
    parser.add_argument("--depth", type=int, default=6, help="hidden layers (2048 x 2048 each: 6 -> 25.2M parameters)")
    parser.add_argument("--iters", type=int, default=3, help="timed DDP steps per method")
    parser.add_argument("--batch", type=int, default=16, help="per-rank batch of the DDP model")
    parser.add_argument("--skip-ddp", action="store_true", help="time the all-reduces only, not DDP steps")
    parser.add_argument("--ddp-only", action="store_true", help="time the DDP steps only")
    parser.add_argument("--fp32-only", action="store_true",
                        help="time gloo's and ddlcomm's float32 all-reduces only (no compression, no DDP)")
    parser.add_argument("--sharded-only", action="store_true",
                        help="time the reduce-scatters and all-gathers of sharded training (b) only")
    parser.add_argument("--ddp-methods", default="",
                        help="comma-separated DDP methods to time (e.g. 'ddlcomm 1-bit hook'; default: all)")
    parser.add_argument("--over-gloo-only", action="store_true",
                        help="time the compressed all-reduce on the gloo group only (two levels under "
                             "DDLCOMM_ALLREDUCE_ALGO=hierarchical where the hosts take them, else flat)")
    args = parser.parse_args()
    init_ranks("ddlcomm")
    gloo = dist.new_group(backend="gloo")
    torch.set_num_threads(1)
    if args.over_gloo_only:
        over_gloo_bench(gloo, args.numel, args.repeats)
        dist.destroy_process_group()
        return
    if args.sharded_only:
        reduce_scatter_bench(gloo, args.numel, args.repeats)
        all_gather_bench(gloo, args.numel, args.repeats)
        dist.destroy_process_group()
        return
    if not args.ddp_only:
        allreduce_bench(gloo, args.numel, args.repeats, compressed=not args.fp32_only)
    if args.fp32_only:
        dist.destroy_process_group()
        return
    if not args.ddp_only:
        reduce_scatter_bench(gloo, args.numel, args.repeats)
        all_gather_bench(gloo, args.numel, args.repeats)
    if not args.skip_ddp:
        ddp_bench(gloo, args.width, args.depth, args.iters, args.batch,
                  [m.strip() for m in args.ddp_methods.split(",") if m.strip()])
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
