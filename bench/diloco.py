"""Outer steps (``ddlcomm.diloco``) on the convergence benchmark's recipes, against DDP.

    torchrun --standalone --nproc-per-node 4 -m bench.diloco --recipe lm-adamw-clip --seeds 3 --out DIR

Each rank trains its replica with the recipe's optimizer, learning-rate schedule and clipping
(``bench.convergence.RECIPES``; the clipping is local, on the replica's own gradient,
which outer steps allow), on the same per-rank batches as the DDP run, and every
``--sync-every`` steps takes an outer step through each compressor. The DDP row is the
convergence benchmark's plain all-reduce on the same recipe and seeds. Rank 0 prints a table
(metric mean ± sd over seeds, and the traffic saved against DDP's float32 all-reduce at every
step) and writes ``diloco.md`` and ``diloco.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import ddlcomm  # noqa: F401  (registers the backend)
from ddlcomm import compressors, optim
from ddlcomm.diloco import DiLoCo
from ddlcomm.replicas import replica_groups
from ddlcomm.wire import ring_all_reduce_bytes

from bench import init_ranks
from bench.convergence import METHODS as DDP_METHODS
from bench.convergence import RECIPES, Recipe, train
from bench.tasks import Task, lr_lambda, make_task

# name -> (compressor factory or None for float32, DiLoCo options)
METHODS: dict[str, tuple[Optional[Callable[[], compressors.Compressor]], dict[str, Any]]] = {
    "DiLoCo fp32": (None, {}),
    "DiLoCo ternary": (compressors.Ternary, {}),
    "DiLoCo 1-bit": (compressors.OneBit, {}),
    "DiLoCo top-k 1%": (compressors.TopK, {}),
    "DiLoCo ternary, no outer momentum (SparseLoCo)": (compressors.Ternary, {"outer_momentum": 0.0, "outer_lr": 1.0}),
    "DiLoCo top-k 1% 2-bit": (lambda: compressors.TopK(0.01, approximate=True, value_bits=2), {}),
    "DiLoCo top-k 5% 2-bit": (lambda: compressors.TopK(0.05, approximate=True, value_bits=2), {}),
    "DiLoCo top-k 5% fp32": (lambda: compressors.TopK(0.05, approximate=True), {}),
    "SparseLoCo (top-k 5% 2-bit, no outer momentum, outer lr 1)": (
        lambda: compressors.TopK(0.05, approximate=True, value_bits=2), {"outer_momentum": 0.0, "outer_lr": 1.0}),
}


def run(task: Task, recipe: Recipe, method: str, seed: int, sync_every: int, outer_lr: float,
        outer_momentum: float = 0.9, warmup_steps: int = 0, warmup_compressed: bool = False,
        ranks_per_replica: int = 1) -> dict:
    """One DiLoCo run on every rank: the final metric and the traffic saved. With
    ``warmup_compressed`` the warm-up's averages go through the method's compressor (update
    directions of a ``ddlcomm.optim`` optimizer); with ``ranks_per_replica`` > 1, consecutive
    ranks train one replica with DDP (a host) and only the outer steps cross between them."""
    make, options = METHODS[method]
    rank = dist.get_rank()
    torch.manual_seed(seed)
    model = task.model()
    ddp: torch.nn.Module = model
    if ranks_per_replica > 1:
        replica, across = replica_groups(ranks_per_replica)
        ddp = DistributedDataParallel(model, process_group=replica)
        options = dict(options, process_group=across, replica_group=replica)
    family = optim if warmup_compressed else torch.optim
    inner = {"sgd": family.SGD, "adam": family.Adam, "adamw": family.AdamW}[recipe.optimizer](
        model.parameters(), lr=recipe.lr, **recipe.options)
    schedule = torch.optim.lr_scheduler.LambdaLR(inner, lr_lambda(task.steps))
    diloco = DiLoCo(model, inner, sync_every=sync_every, compressor=make() if make else None,
                    warmup_steps=warmup_steps, warmup_compressor=make() if make and warmup_compressed else None,
                    **{"outer_lr": outer_lr, "outer_momentum": outer_momentum, **options})
    g = torch.Generator().manual_seed(seed * 1000 + rank)  # the DDP run's batches
    for _ in range(task.steps):
        inner.zero_grad()
        for _ in range(recipe.micro_batches):
            x, y = task.batch(g)
            task.loss(ddp, x, y).backward()  # summed, as the DDP run does
        if recipe.clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.clip)
        inner.step()
        schedule.step()
        diloco.step()
    if diloco.inner_steps % sync_every:
        diloco.sync()  # end on the global weights
    # Against DDP's float32 ring over every rank: what a rank sends between replicas (hosts).
    numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
    ddp_bytes = task.steps * ring_all_reduce_bytes(numel * 4, dist.get_world_size())
    return {"metric": task.evaluate(model), "reduction": ddp_bytes / diloco.stats.bytes_sent}


def _cell(task: Task, runs: list[dict], base: Optional[float]) -> str:
    values = [r["metric"] for r in runs]
    mean = statistics.fmean(values)
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    text = f"{mean:.3f} ± {sd:.3f}" if not task.higher_is_better else f"{mean:.2f} ± {sd:.2f}"
    if base is not None:
        text += f" ({(mean - base) / base * 100:+.1f}%)" if not task.higher_is_better else f" ({mean - base:+.2f})"
    return text


def table(task: Task, recipe_name: str, results: dict, sync_every: int, outer_lr: float, outer_momentum: float) -> str:
    metric = "accuracy %" if task.higher_is_better else "validation loss"
    lines = [f"| method ({recipe_name}, {task.steps} steps, outer steps every {sync_every}, outer Nesterov SGD lr "
             f"{outer_lr:g} momentum {outer_momentum:g} unless named) "
             f"| {metric}, mean ± sd | traffic ÷ (vs DDP float32) |", "| --- | --- | --- |"]
    base = statistics.fmean(r["metric"] for r in results["DDP all-reduce"])
    for name, runs in results.items():
        reduction = statistics.fmean(r["reduction"] for r in runs)
        lines.append(f"| {name} | {_cell(task, runs, None if name == 'DDP all-reduce' else base)} | {reduction:.0f}x |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="lm-adamw-clip", choices=sorted(RECIPES), help="the recipe to train")
    parser.add_argument("--methods", default=None, help=f"';'-separated subset of {list(METHODS)}".replace("%", "%%"))
    parser.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 per method")
    parser.add_argument("--steps", type=int, default=None, help="inner steps (default: the task's)")
    parser.add_argument("--sync-every", type=int, default=10, help="inner steps between outer steps (H)")
    parser.add_argument("--outer-lr", type=float, default=0.7, help="the outer Nesterov SGD's learning rate")
    parser.add_argument("--outer-momentum", type=float, default=0.5,
                        help="its momentum (default 0.5: better than DiLoCo's 0.9 on 300 steps, docs/diloco.md)")
    parser.add_argument("--warmup-steps", type=int, default=0,
                        help="first inner steps on the replicas' average gradient (clipped on each rank first)")
    parser.add_argument("--warmup-compressed", action="store_true",
                        help="the warm-up through each method's compressor (ddlcomm.optim's update directions)")
    parser.add_argument("--ranks-per-replica", type=int, default=1,
                        help="consecutive ranks that train one replica with DDP (two levels: a host's ranks)")
    parser.add_argument("--out", type=Path, default=None, help="directory for diloco.md and diloco.json")
    args = parser.parse_args()
    init_ranks("ddlcomm")
    torch.set_num_threads(1)
    recipe = RECIPES[args.recipe]
    task = make_task(recipe.task, **({"steps": args.steps} if args.steps else {}))
    methods = args.methods.split(";") if args.methods else list(METHODS)
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise SystemExit(f"unknown methods {unknown}; choose from {list(METHODS)}")
    results: dict[str, list[dict]] = {}
    results["DDP all-reduce"] = [train(task, DDP_METHODS["all-reduce"], recipe.optimizer, s, recipe=recipe)
                                 for s in range(args.seeds)]
    for method in methods:
        # float32 methods warm up in float32 even with --warmup-compressed
        compressed = args.warmup_compressed and METHODS[method][0] is not None
        name = method + (f", {args.warmup_steps}{' compressed' if compressed else ''} warm-up steps"
                         if args.warmup_steps else "")
        name += f", replicas of {args.ranks_per_replica} ranks" if args.ranks_per_replica > 1 else ""
        results[name] = [run(task, recipe, method, s, args.sync_every, args.outer_lr, args.outer_momentum,
                             args.warmup_steps, args.warmup_compressed, args.ranks_per_replica)
                         for s in range(args.seeds)]
        if dist.get_rank() == 0:
            print(f"RESULT {name}: {json.dumps(results[name])}", flush=True)
    if dist.get_rank() == 0:
        text = table(task, args.recipe, results, args.sync_every, args.outer_lr, args.outer_momentum)
        print(text, flush=True)
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "diloco.md").write_text(text + "\n")
            (args.out / "diloco.json").write_text(json.dumps({"recipe": args.recipe, "sync_every": args.sync_every,
                                                              "outer_lr": args.outer_lr,
                                                              "outer_momentum": args.outer_momentum,
                                                              "results": results}, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
