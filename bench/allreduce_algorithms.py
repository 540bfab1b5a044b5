"""Each all-reduce algorithm of ddlcomm, forced per group, and gloo's, timed at several sizes on
whatever network the ranks run on: the measurements the cost model (bench.cost_model) is
fitted to and checked against. Launched once per rank (env:// rendezvous), normally by
``bench.slownet.run_cost_model`` inside emulated hosts. Rank 0 prints one ``RESULT
{json}`` line per algorithm and size: the median of ``--repeats`` timed calls.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time

import torch
import torch.distributed as dist

import ddlcomm

ALGORITHMS = ("ring", "recursive_doubling", "halving_doubling", "hierarchical")


def timed(call, repeats: int, warmup: int = 1) -> float:
    """Median seconds of ``repeats`` calls after ``warmup`` untimed ones (an all-reduce ends
    when every rank's data has arrived, so each call synchronises the ranks)."""
    for _ in range(warmup):
        call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="65536,1048576,8388608", help="comma-separated all-reduce sizes in bytes")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per algorithm and size")
    parser.add_argument("--warmup", type=int, default=1,
                        help="untimed calls first (TCP's windows open as connections carry data)")
    parser.add_argument("--algorithms", default=",".join(("gloo",) + ALGORITHMS),
                        help="comma-separated: gloo and any of " + ", ".join(ALGORITHMS))
    args = parser.parse_args()
    chosen = args.algorithms.split(",")
    dist.init_process_group("ddlcomm")
    rank, n = dist.get_rank(), dist.get_world_size()
    world = dist.group.WORLD._get_backend(torch.device("cpu"))
    topology = world.stats()["topology"]
    groups = {"gloo": dist.new_group(backend="gloo")} if "gloo" in chosen else {}
    for algorithm in (a for a in ALGORITHMS if a in chosen):
        layout = re.fullmatch(r"(\d+) hosts x (\d+) ranks", topology)
        if algorithm == "hierarchical" and not layout:
            continue  # needs several hosts with as many ranks (> 1) on each
        groups[algorithm] = dist.new_group(backend="ddlcomm",
                                           pg_options=ddlcomm.Options(allreduce_algorithm=algorithm))
    for size in (int(s) for s in args.sizes.split(",")):
        data = torch.zeros(size // 4)
        for name, group in groups.items():
            seconds = timed(lambda: dist.all_reduce(data, group=group), args.repeats, args.warmup)
            if rank == 0:
                print("RESULT " + json.dumps({"algorithm": name, "bytes": size, "seconds": seconds, "ranks": n,
                                              "topology": topology}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
