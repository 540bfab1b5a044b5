"""Training-quality scenarios for tests/test_convergence.py, run on every rank.

The task is the convergence benchmark's MLP (``ddlcomm.bench.tasks``): 4 ranks, 300 steps,
warm-up and cosine schedule, at the learning rates that are best for plain all-reduce.
"""

from __future__ import annotations

import json

import torch

from common import init, run
from ddlcomm.bench.convergence import METHODS, train
from ddlcomm.bench.tasks import make_task


def quality(runs: str, seeds: str = "0") -> None:
    """``runs``: "optimizer:method;..." (method names of ddlcomm.bench.convergence.METHODS).
    Prints ``QUALITY {optimizer: {method: [accuracy per seed]}}`` on rank 0."""
    rank, _ = init(timeout_s=300)
    torch.set_num_threads(1)
    task = make_task("mlp")
    out: dict = {}
    for item in runs.split(";"):
        opt_name, name = item.split(":", 1)
        out.setdefault(opt_name, {})[name] = [train(task, METHODS[name], opt_name, int(s))["metric"]
                                              for s in seeds.split(",")]
    if rank == 0:
        print("QUALITY " + json.dumps(out), flush=True)


if __name__ == "__main__":
    run({"quality": quality})
