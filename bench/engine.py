"""The compressed all-reduce on a gloo group against the same call on a ddlcomm group, and
against gloo moving the same payload bytes itself, in the same run.

Run under torchrun from the repository root, e.g.::

    torchrun --standalone --nproc-per-node 2 -m bench.engine --out docs/results/engine.md

Both groups run the one C++ implementation as an operation on the executor of their ddlcomm
backend (``ddlcomm.compressed.engine_of``): the ddlcomm group's own collectives on its
transport, the gloo group's over gloo's send and recv, or through shared memory where the group
is on one host as on loopback (``DDLCOMM_TRANSPORT=tcp``: over gloo's send and recv there too,
and TCP for the ddlcomm group). "gloo moving the payload" is gloo's own
``all_to_all_single`` of the bytes each rank scatters plus ``all_gather_single`` of the bytes it
gathers (one call each for all pieces, a floor). The ratio is gloo group / (ddlcomm group + gloo
moving the payload): at 1 the call on a gloo group costs what its computation costs plus what
gloo takes to move its bytes. "host ms" is how long the caller spends in
``compressed_all_reduce`` before it has a future back (the C++ call a DDP hook makes per bucket;
``--ddp`` times the whole hook). "gloo collectives path" is the same implementation on the
caller's thread over gloo's own all-to-all and all-gather
(``ddlcomm.compressed.all_reduce_over_collectives``, the path of CUDA tensors and nccl groups,
here on the CPU tensors). Calls pass ``verify=False``, as the DDP hooks do after a bucket's
first call. Each time is the median of --repeats, the slowest rank's.

The calls on the two groups, over gloo's collectives and gloo moving the payload are timed in
turns (one of each a round): timed one after another, the first takes the machine's drift alone.

With ``--ddp`` it times DDP steps of an MLP (SGD) with the 1-bit hook on each group instead,
against the same step with the hook waited inside (the bucket's all-reduce done before backward
goes on: no overlap), DDP without communication (torch's ``noop_hook``, which returns each
bucket as it is: the backward pass with DDP's own bucket copies) and the 1-bit all-reduces of
its gradient in DDP's 25 MB buckets one after another (communication alone), all in turns. A
step below "without + communication", and below the waited step, overlaps the backward pass with
communication. "hook ms per bucket" is how long the hook takes to return a bucket's future, on
the wall clock and in the CPU time of the thread that calls it (the median over the timed steps'
buckets but each iteration's last, which waits for all of them; the slowest rank's): what a
bucket costs the backward pass, and how much of that is the hook's own work rather than waiting
for a core. Run it on emulated hosts too, e.g. ``python -m ddlcomm.slownet --ranks 2 --rate
1gbit -- python -m bench.engine --ddp``.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import shlex
import statistics
import sys
import time
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from torch.distributed.algorithms.ddp_comm_hooks.debugging_hooks import noop_hook
from torch.nn.parallel import DistributedDataParallel

from ddlcomm import _C, compressors, hooks
from ddlcomm.compressed import all_reduce_over_collectives, compressed_all_reduce, server_residual_numel
from ddlcomm.wire import all_gather_single

from bench import init_ranks

COMPRESSORS: dict[str, Callable[[], compressors.Compressor]] = {
    "1-bit": compressors.OneBit,
    "ternary": compressors.Ternary,
    "top-k 1%": lambda: compressors.TopK(ratio=0.01, approximate=True),
}


def slowest_medians(calls: dict[str, Callable[[], None]], repeats: int) -> dict[str, float]:
    """The median over `repeats` of the slowest rank's seconds for each call (after one warm-up),
    timed in turns (one call of each a round, the order reversed every round), so that the
    machine's drift falls on all of them alike."""
    for call in calls.values():
        call()
    times: dict[str, list[float]] = {name: [] for name in calls}
    for round_ in range(repeats):
        for name in (list(calls) if round_ % 2 == 0 else list(calls)[::-1]):
            dist.barrier()
            start = time.perf_counter()
            calls[name]()
            times[name].append(time.perf_counter() - start)
    slowest = torch.tensor([times[name] for name in calls])
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return {name: statistics.median(row) for name, row in zip(calls, slowest.tolist())}


def payload_move(compressor: compressors.Compressor, numel: int, gloo: dist.ProcessGroup) -> Callable[[], None]:
    """gloo's all-to-all of what this rank scatters and all-gather of what it gathers, in bytes."""
    n, r = dist.get_world_size(gloo), dist.get_rank(gloo)
    if compressor.is_sparse:
        payload = torch.zeros(compressor.compressed_nbytes(numel), dtype=torch.uint8)
        everyone = torch.empty(n * payload.numel(), dtype=torch.uint8)
        return lambda: all_gather_single(everyone, payload, group=gloo)
    send, recv, widest = [0] * n, [0] * n, 0
    for _, _, bounds in _C.ProcessGroupDdlcomm.compressed_allreduce_pieces(numel, n):
        sizes = [compressor.compressed_nbytes(bounds[i + 1] - bounds[i]) for i in range(n)]
        for i in range(n):
            send[i] += sizes[i]
            recv[i] += sizes[r]
        widest += max(sizes)
    outgoing, incoming = torch.zeros(sum(send), dtype=torch.uint8), torch.empty(sum(recv), dtype=torch.uint8)
    reduced, gathered = torch.zeros(widest, dtype=torch.uint8), torch.empty(n * widest, dtype=torch.uint8)

    def move() -> None:
        dist.all_to_all_single(incoming, outgoing, recv, send, group=gloo)
        all_gather_single(gathered, reduced, group=gloo)
    return move


def measure(name: str, numel: int, groups: dict[str, dist.ProcessGroup], repeats: int) -> dict[str, float]:
    """The call on each group, over gloo's collectives, and gloo moving its payload, timed in
    turns; then the host time of the call on each group."""
    compressor = COMPRESSORS[name]()
    n, r = dist.get_world_size(), dist.get_rank()
    grad = torch.randn(numel, generator=torch.Generator().manual_seed(r))
    worker = torch.zeros(numel)
    server = torch.zeros(server_residual_numel(numel, r, n))
    steps = iter(range(1 << 30))

    def on(group: dist.ProcessGroup) -> Callable[[], None]:
        return lambda: compressed_all_reduce(grad, compressor, worker, server, group=group, stream=next(steps),
                                             verify=False).wait()
    calls = {label: on(group) for label, group in groups.items()}
    calls["collectives"] = lambda: all_reduce_over_collectives(grad, compressor, worker, server, groups["gloo"],
                                                               True, next(steps), False, False)
    calls["move"] = payload_move(compressor, numel, groups["gloo"])
    row = slowest_medians(calls, repeats)
    for label, group in groups.items():
        hosts = []
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            fut = compressed_all_reduce(grad, compressor, worker, server, group=group, stream=next(steps), verify=False)
            hosts.append(time.perf_counter() - start)
            fut.wait()
        row[label + " host"] = statistics.median(hosts)
    return row


def ddp_rows(groups: dict[str, dist.ProcessGroup], width: int, depth: int, batch: int, repeats: int) -> list[str]:
    """Per group: the DDP step with the 1-bit hook, the same hook waited inside (no overlap), DDP
    without communication (torch's ``noop_hook``) and the all-reduces alone, in ms, all
    timed in turns; the step over their sum and over the waited step."""
    r, n = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(width, 10))
    x = torch.randn(batch, width, generator=torch.Generator().manual_seed(r))
    y = torch.randint(0, 10, (batch,), generator=torch.Generator().manual_seed(r))

    def stepper(module: torch.nn.Module) -> Callable[[], None]:
        opt = torch.optim.SGD(module.parameters(), lr=1e-3)

        def step() -> None:
            opt.zero_grad()
            torch.nn.functional.cross_entropy(module(x), y).backward()
            opt.step()
        return step

    # DDP rejects a hook whose annotations are not dist.GradBucket and Future[Tensor] themselves,
    # and this module's annotations are strings: the hooks below go without.
    def waited(state, bucket):  # type: ignore[no-untyped-def]
        fut = hooks.compressed_hook(state, bucket)
        fut.wait()
        return fut

    def timed(seconds: list[tuple[float, float]]) -> Callable[..., torch.futures.Future[torch.Tensor]]:
        """The hook, appending the wall and the calling thread's CPU seconds of each call but the
        iteration's last (which waits for every bucket's communication) to `seconds`."""
        def hook(state, bucket):  # type: ignore[no-untyped-def]
            wall, cpu = time.perf_counter(), time.thread_time()
            fut = hooks.compressed_hook(state, bucket)
            if not bucket.is_last():
                seconds.append((time.perf_counter() - wall, time.thread_time() - cpu))
            return fut
        return hook

    numel = sum(p.numel() for p in model.parameters())
    bucket = (25 << 20) // 4
    calls: dict[str, Callable[[], None]] = {}
    hook_seconds: dict[str, list[tuple[float, float]]] = {label: [] for label in groups}
    for label, group in groups.items():
        grads = [torch.randn(min(bucket, numel - b)) for b in range(0, numel, bucket)]
        memory = [(torch.zeros(g.numel()), torch.zeros(server_residual_numel(g.numel(), r, n))) for g in grads]

        def communicate(group: dist.ProcessGroup = group, grads: list[torch.Tensor] = grads,
                        memory: list[tuple[torch.Tensor, torch.Tensor]] = memory,
                        streams: Iterator[int] = iter(range(1 << 30))) -> None:
            for g, (w, s) in zip(grads, memory):
                compressed_all_reduce(g, compressors.OneBit(), w, s, group=group, stream=next(streams),
                                      verify=False).wait()
        calls[f"{label} communication"] = communicate
        for kind, hook in (("step", timed(hook_seconds[label])), ("waited", waited), ("without", noop_hook)):
            ddp = DistributedDataParallel(copy.deepcopy(model), process_group=group)
            ddp.register_comm_hook(None if hook is noop_hook else
                                   hooks.CompressionState(group, compressors.OneBit(), start_compress_iter=2), hook)
            calls[f"{label} {kind}"] = stepper(ddp)
            for _ in range(3):  # past the hook's warm-up and DDP's bucket rebuild
                calls[f"{label} {kind}"]()
        hook_seconds[label].clear()
    ms = {name: seconds * 1e3 for name, seconds in slowest_medians(calls, repeats).items()}
    # A model of one bucket has no bucket but the last: nan.
    host = torch.tensor([[statistics.median(t[i] for t in hook_seconds[label]) * 1e3 if hook_seconds[label] else
                          math.nan for i in (0, 1)] for label in groups])
    dist.all_reduce(host, op=dist.ReduceOp.MAX)
    rows = []
    for label, (wall_ms, cpu_ms) in zip(groups, host.tolist()):
        step, waited_step, without, comm = (ms[f"{label} {kind}"] for kind in ("step", "waited", "without",
                                                                              "communication"))
        rows.append(f"| {label} | {step:.1f} | {waited_step:.1f} | {without:.1f} | {comm:.1f} | "
                    f"{step / (without + comm):.2f} | {step / waited_step:.2f} | {wall_ms:.3f} / {cpu_ms:.3f} |")
        if r == 0:
            print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[1, 26, 105],
                        help="gradient sizes in MB of float32")
    parser.add_argument("--compressors", nargs="+", default=list(COMPRESSORS), choices=list(COMPRESSORS),
                        help="the compressors to time")
    parser.add_argument("--repeats", type=int, default=7, help="timed calls per measurement (the median is reported)")
    parser.add_argument("--out", help="also append the table (markdown) to this file")
    parser.add_argument("--ddp", action="store_true", help="time DDP steps with the 1-bit hook instead")
    parser.add_argument("--width", type=int, default=2048, help="--ddp: the MLP's width")
    parser.add_argument("--depth", type=int, default=6, help="--ddp: its hidden layers (6: 25.2M parameters)")
    parser.add_argument("--batch", type=int, default=16, help="--ddp: each rank's batch")
    parser.add_argument("--where", default="loopback", help="what the table says the ranks ran on")
    args = parser.parse_args()
    init_ranks("gloo")
    torch.set_num_threads(1)
    groups = {"ddlcomm": dist.new_group(backend="ddlcomm"), "gloo": dist.group.WORLD}
    command = (f"`torchrun --standalone --nproc-per-node {dist.get_world_size()} -m bench.engine "
               f"{shlex.join(sys.argv[1:])}`" if args.where == "loopback" else
               f"`python -m ddlcomm.slownet --ranks {dist.get_world_size()} ... -- python -m bench.engine "
               f"{shlex.join(sys.argv[1:])}`")
    lines = [f"{dist.get_world_size()} ranks on {args.where}, median of {args.repeats}, the slowest rank's. "
             f"Command: {command}", ""]
    if args.ddp:
        lines += ["| 1-bit hook on | DDP step ms | hook waited inside ms | DDP without communication ms | "
                  "communication alone ms | step / (without + communication) | step / waited | "
                  "hook ms per bucket, wall / CPU |", "|---|---|---|---|---|---|---|---|"]
        lines += ddp_rows(groups, args.width, args.depth, args.batch, args.repeats)
    else:
        lines += ["| compressor, gradient | ddlcomm group ms | gloo group ms | gloo moving the payload ms | ratio | "
                  "host ms, ddlcomm / gloo | gloo collectives path ms |", "|---|---|---|---|---|---|---|"]
    for name in ([] if args.ddp else args.compressors):
        for mb in args.sizes_mb:
            row = measure(name, int(mb * (1 << 20)) // 4, groups, args.repeats)
            ratio = row["gloo"] / (row["ddlcomm"] + row["move"])
            lines.append(f"| {name}, {mb:g} MB | {row['ddlcomm'] * 1e3:.2f} | {row['gloo'] * 1e3:.2f} | "
                         f"{row['move'] * 1e3:.2f} | {ratio:.2f} | {row['ddlcomm host'] * 1e3:.3f} / "
                         f"{row['gloo host'] * 1e3:.3f} | {row['collectives'] * 1e3:.2f} |")
            if dist.get_rank() == 0:
                print(lines[-1], flush=True)
    if dist.get_rank() == 0 and args.out:  # a section per run: one file holds the 2- and 4-rank runs
        fresh = not os.path.exists(args.out)
        with open(args.out, "a") as f:
            f.write(("# The compressed all-reduce on gloo and ddlcomm groups\n\n" + __doc__ + "\n" if fresh else "")
                    + f"## {'DDP steps, ' if args.ddp else ''}{dist.get_world_size()} ranks on {args.where}\n\n"
                    + "\n".join(lines) + "\n\n")
        print(f"wrote {args.out}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
