"""Training-quality scenarios for tests/test_convergence.py, run on every rank.

The task is the convergence benchmark's MLP (``bench.tasks``): 300 steps, warm-up and
cosine schedule, at the learning rates that are best for plain all-reduce, and the benchmark's
global batch of 128 split over the ranks.
"""

from __future__ import annotations

import json

import torch
import torch.distributed as dist

from common import init, run
from bench import time_to_accuracy
from bench.convergence import METHODS, train
from bench.tasks import make_task

GLOBAL_BATCH = 128  # the benchmark's 4 ranks x 32


def quality(runs: str, seeds: str = "0", sharding: str = "ddp") -> None:
    """``runs``: "optimizer:method;..." (method names of bench.convergence.METHODS),
    with DDP hooks or FSDP2 (``sharding``). Prints ``QUALITY {optimizer: {method: [accuracy
    per seed]}}`` on rank 0."""
    rank, _ = init(timeout_s=300)
    torch.set_num_threads(1)
    task = make_task("mlp", batch=GLOBAL_BATCH // dist.get_world_size())
    out: dict = {}
    for item in runs.split(";"):
        opt_name, name = item.split(":", 1)
        out.setdefault(opt_name, {})[name] = [train(task, METHODS[name], opt_name, int(s), sharding=sharding)["metric"]
                                              for s in seeds.split(",")]
    if rank == 0:
        print("QUALITY " + json.dumps(out), flush=True)


def outer_steps_quality(recipe_name: str, method: str, seed: str) -> None:
    """DDP and ``bench.diloco``'s ``method`` with ``ddlcomm.diloco.DiLoCo``'s default outer
    learning rate and momentum, one seed of ``recipe_name``: prints ``OUTER {"ddp": loss,
    "diloco": loss}`` on rank 0."""
    import inspect

    from bench import diloco
    from bench.convergence import RECIPES
    from ddlcomm.diloco import DiLoCo

    rank, _ = init(timeout_s=300)
    torch.set_num_threads(1)
    recipe = RECIPES[recipe_name]
    task = make_task(recipe.task)
    defaults = inspect.signature(DiLoCo.__init__).parameters
    ddp = train(task, METHODS["all-reduce"], recipe.optimizer, int(seed), recipe=recipe)["metric"]
    outer = diloco.run(task, recipe, method, int(seed), 10, defaults["outer_lr"].default,
                       defaults["outer_momentum"].default)["metric"]
    if rank == 0:
        print("OUTER " + json.dumps({"ddp": ddp, "diloco": outer}), flush=True)


def time_to_accuracy_curves(task_name: str, opt_name: str) -> None:
    """Every method of the time-to-accuracy benchmark, 14 steps of a small ``task_name``
    (compressed from step 10): prints its records as ``RESULTS [...]`` on rank 0."""
    rank, _ = init(timeout_s=300)
    torch.set_num_threads(1)
    gloo = dist.new_group(backend="gloo")
    task = make_task(task_name, batch=8, steps=14, **({} if task_name == "mlp" else {"width": 64}))
    records = []
    for method in time_to_accuracy.METHODS:
        outer = {"sync_every": 7, "outer_lr": 0.7, "outer_momentum": 0.5}  # DiLoCo: evaluated after each outer step
        record = time_to_accuracy.run(task, method, opt_name, gloo, eval_every=7, outer=outer)
        records.append(dict(record, task=task_name, rate="loopback", metric=task.metric))
    if rank == 0:
        print("RESULTS " + json.dumps(records), flush=True)


if __name__ == "__main__":
    run()
