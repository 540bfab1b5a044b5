"""The adaptive DDP hook against no hook and the fixed hooks, step for step: is it ever slower?

Separate runs of each method vary more between runs on a shared machine than the few percent in
question (docs/results/adaptive.md). Here every
method trains its own copy of the 25.2M-parameter MLP in one process, past its warm-up and the
adaptive hooks' measurement, and then the methods take turns, one step each per round in an
order that rotates from round to round, so that whatever the machine does at a moment falls on
all of them alike. Per round, each method's step time over no hook's (and over each fixed
hook's) is one paired ratio; the report gives the median ratio and the order-statistic 95%
interval of that median (the slowest rank's time per step).

    torchrun --standalone --nproc-per-node 4 -m bench.adaptive_paired --rounds 40

On emulated hosts of several ranks, against the fixed 1-bit hook in two levels and in one
(a group with ``allreduce_algorithm="ring"``):

    python -m bench.slownet.run_compressed --module bench.adaptive_paired \
        --rates 1gbit --ranks 2 --ranks-per-host 2 --out DIR -- --rounds 30 \
        --methods "fixed 1-bit hook,fixed 1-bit hook (one level),adaptive 1-bit hook"
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import ddlcomm
from ddlcomm import compressors, hooks

from bench import init_ranks
from bench.compressed import make_model


def median_interval(ratios: list[float]) -> tuple[float, float]:
    """The 95% interval of the median from order statistics (binomial, normal approximation)."""
    ordered, k = sorted(ratios), len(ratios)
    half = 1.96 * math.sqrt(k) / 2
    low, high = max(0, math.floor(k / 2 - half)), min(k - 1, math.ceil(k / 2 + half) - 1)
    return ordered[low], ordered[high]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=40, help="timed steps per method")
    parser.add_argument("--width", type=int, default=2048, help="hidden width of the MLP")
    parser.add_argument("--depth", type=int, default=6, help="hidden layers (2048 x 2048 each: 6 -> 25.2M parameters)")
    parser.add_argument("--batch", type=int, default=16, help="per-rank batch")
    parser.add_argument("--bucket-cap-mb", type=float, default=25, help="DDP's bucket_cap_mb")
    parser.add_argument("--methods", default="no hook,fixed 1-bit hook,adaptive fp16 hook,adaptive 1-bit hook",
                        help=f"comma-separated, among: {', '.join(METHODS)}")
    args = parser.parse_args()
    names = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = sorted(set(names) - set(METHODS))
    if unknown:
        raise SystemExit(f"--methods: no method {unknown}; the methods: {list(METHODS)}")
    init_ranks("ddlcomm")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    x = torch.randn(args.batch, args.width, generator=torch.Generator().manual_seed(rank))
    y = torch.randint(0, 10, (args.batch,), generator=torch.Generator().manual_seed(rank))
    methods = {name: METHODS[name]() for name in names}
    steps = {}
    for name, state in methods.items():
        model = make_model(args.width, args.depth)
        ddp = DistributedDataParallel(model, process_group=None if state is None else state.process_group,
                                      bucket_cap_mb=args.bucket_cap_mb)
        if state is not None:
            ddp.register_comm_hook(state, hooks.compressed_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)

        def step(ddp=ddp, opt=opt) -> None:
            opt.zero_grad()
            torch.nn.functional.cross_entropy(ddp(x), y).backward()
            opt.step()

        tuner = getattr(state, "tuner", None)
        for _ in range(24):  # past the warm-up (2) and the allocations
            step()
        while tuner is not None and not tuner.settled(state.iter):  # past its measurement (4 + 3 x 10 at most)
            step()
        steps[name] = step

    seconds: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(args.rounds):
        for name in names[round_ % len(names):] + names[:round_ % len(names)]:
            dist.barrier()
            start = time.perf_counter()
            steps[name]()
            took = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
            seconds[name].append(float(took))
    if rank != 0:
        dist.destroy_process_group()
        return
    references = [n for n in names if getattr(methods[n], "tuner", None) is None]  # no hook and the fixed hooks
    for name in names:
        tuner = getattr(methods[name], "tuner", None)
        record = {"kind": "paired", "method": name, "seconds": statistics.median(seconds[name]),
                  "speedup": statistics.median(seconds[references[0]]) / statistics.median(seconds[name]),
                  "rounds": args.rounds, "choice": None if tuner is None else tuner.name(tuner.choice),
                  "measured": None if tuner is None else tuner.measured,
                  "costs": None if tuner is None else tuner.costs, "plan": None if tuner is None else
                  [tuner.name(o) for o in tuner.buckets]}
        for reference in references:
            if reference != name:
                ratios = [t / base for t, base in zip(seconds[name], seconds[reference])]
                record[f"ratio_to {reference}"] = [statistics.median(ratios), *median_interval(ratios)]
        print("RESULT " + json.dumps(record), flush=True)
    dist.destroy_process_group()


def _one_level(compressor: compressors.Compressor) -> hooks.CompressionState:
    """A fixed hook in one level where the world takes two: over a group whose algorithm is the ring."""
    ring = dist.new_group(backend="ddlcomm", pg_options=ddlcomm.Options(allreduce_algorithm="ring"))
    return hooks.CompressionState(ring, compressor, start_compress_iter=2)


METHODS = {  # name -> its state (None: DDP's own all-reduce), made after init
    "no hook": lambda: None,
    "fixed 1-bit hook": lambda: hooks.CompressionState(None, compressors.OneBit(), start_compress_iter=2),
    "fixed 1-bit hook (one level)": lambda: _one_level(compressors.OneBit()),
    "adaptive fp16 hook": lambda: hooks.CompressionState(None, compressors.FP16(), start_compress_iter=2,
                                                         adaptive=True),
    "adaptive 1-bit hook": lambda: hooks.CompressionState(None, compressors.OneBit(), start_compress_iter=2,
                                                          adaptive=True),
}


if __name__ == "__main__":
    main()
