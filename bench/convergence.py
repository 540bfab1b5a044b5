"""Does compressed training reach the accuracy of plain all-reduce? Multi-rank, under torchrun.

    torchrun --nproc-per-node 4 -m bench.convergence --out docs/results

For each task (``bench.tasks``: an MLP and a CNN classifying digits, a character-level
transformer on CPython's documentation), each optimizer (SGD with momentum 0.9, AdamW) at the
learning rate that is best for plain all-reduce (``--sweep`` shows the search), and each
method, it trains with several seeds and reports the final accuracy (or validation loss) as
mean and standard deviation, next to the run's traffic reduction: the bytes a plain ring
all-reduce would have sent, divided by the bytes sent, warm-up and uncompressed buckets
included. Rank 0 prints a table and writes ``convergence.md`` and ``convergence.json`` to
``--out``.

Methods: plain all-reduce; PyTorch's fp16_compress_hook and PowerSGD (rank 4); each ddlcomm
compressor through its hook with a ``ddlcomm.optim`` optimizer (the recommended use); the
1-bit hook compressing gradients (no ``optimizer=``), the configuration that loses accuracy
with momentum and Adam; and top-k with Deep Gradient Compression's options instead of an
optimizer. Every compressed method starts compressing after ``--start-compress-iter`` (10) of
the 300 steps, PowerSGD included.

``--sharding fsdp`` trains with FSDP2 instead (``fully_shard`` on every child module with
parameters, then the root): "all-reduce" is then FSDP2's own reduce-scatter, and each ddlcomm
compressor compresses it through ``ddlcomm.fsdp`` with torch's optimizers, SGD's momentum
moved into the reduce-scatter (``momentum=``); "on gradients" keeps it in the optimizer; "8-bit
all-gather" quantizes the parameter all-gathers (``ddlcomm.fsdp.quantize_all_gather``), alone
or with a compressor. The torch hooks and DGC do not apply.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

import ddlcomm  # noqa: F401  (registers the backend)
from ddlcomm import compressors, fsdp, hooks, optim
from ddlcomm.wire import ring_all_reduce_bytes

from bench import init_ranks
from bench.tasks import Task, lr_lambda, make_task

START_COMPRESS_ITER = 10
OPTIMIZERS = ("sgd", "adamw")
OPTIMIZER_LABELS = {"sgd": "SGD momentum 0.9", "adamw": "AdamW"}


@dataclass
class Method:
    """How one configuration communicates: a compressor for the ddlcomm hook, or a torch hook."""

    name: str
    compressor: Optional[Callable[[], compressors.Compressor]] = None
    direction: bool = True  # ddlcomm hooks: pass the optimizer (average update directions)
    torch_hook: Optional[str] = None  # "fp16" or "powersgd"
    hook_options: dict = field(default_factory=dict)  # more CompressionState arguments
    sgd_momentum: float = 0.9  # the SGD optimizer's own momentum
    optimizers: tuple[str, ...] = ("sgd", "adamw")
    quantize_all_gather: bool = False  # FSDP2 only: 8-bit parameter all-gathers (ddlcomm.fsdp)


ADAMW = {"betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}  # torch's defaults, stated


@dataclass(frozen=True)
class Recipe:
    """A training recipe as people run it: a task, a torch optimizer with its options and
    learning rate (warm-up and cosine, as every task), and what the script does between
    ``backward()`` and ``step()``."""

    label: str
    task: str
    optimizer: str  # "sgd", "adam" or "adamw"
    lr: float
    options: dict = field(default_factory=dict)
    clip: Optional[float] = None  # torch.nn.utils.clip_grad_norm_'s max_norm
    micro_batches: int = 1  # gradient accumulation: all but the last under no_sync()


RECIPES = {
    "lm-adamw-clip": Recipe("char transformer, AdamW (0.9, 0.95) wd 0.1 lr 2e-3, clip 1.0", "lm", "adamw", 2e-3,
                            {"betas": (0.9, 0.95), "weight_decay": 0.1}, clip=1.0),
    "mlp-nesterov": Recipe("MLP, SGD nesterov 0.9 wd 5e-4 lr 0.05", "mlp", "sgd", 0.05,
                           {"momentum": 0.9, "nesterov": True, "weight_decay": 5e-4}),
    "cnn-adam": Recipe("CNN with BatchNorm, Adam lr 2e-3", "cnn", "adam", 2e-3),
    "gru-adam": Recipe("GRU char LM, Adam lr 3e-3", "gru", "adam", 3e-3),
    "mlp-accum-clip": Recipe("MLP, SGD 0.9 lr 0.05, 2 micro-batches (no_sync), clip 1.0", "mlp", "sgd", 0.05,
                             {"momentum": 0.9}, clip=1.0, micro_batches=2),
}

METHODS = {
    m.name: m
    for m in (
        Method("all-reduce"),
        Method("fp16 (torch hook)", torch_hook="fp16"),
        Method("PowerSGD rank 4 (torch hook)", torch_hook="powersgd"),
        Method("1-bit", compressors.OneBit),
        Method("ternary", compressors.Ternary),
        Method("top-k 1%", lambda: compressors.TopK(ratio=0.01, approximate=True)),
        Method("random-k 10%", lambda: compressors.RandomK(ratio=0.1)),
        Method("1-bit on gradients (no optimizer=)", compressors.OneBit, direction=False),
        # Deep Gradient Compression's recipe: torch SGD without momentum; the hook accumulates
        # the momentum locally, clears what it sent, and clips each rank's gradient.
        Method("top-k 1% DGC (hook momentum + clipping)", lambda: compressors.TopK(ratio=0.01, approximate=True),
               direction=False, hook_options={"momentum": 0.9, "clip_norm": 4.0}, sgd_momentum=0.0,
               optimizers=("sgd",)),
        Method("1-bit block 64", lambda: compressors.OneBit(block_size=64)),
        Method("ternary block 64", lambda: compressors.Ternary(block_size=64)),
        Method("bf16", compressors.BF16),
        Method("8-bit all-gather", quantize_all_gather=True),
        Method("1-bit + 8-bit all-gather", compressors.OneBit, quantize_all_gather=True),
        Method("1-bit block 64 + 8-bit all-gather", lambda: compressors.OneBit(block_size=64), quantize_all_gather=True),
        Method("ternary + 8-bit all-gather", compressors.Ternary, quantize_all_gather=True),
        Method("bf16 + 8-bit all-gather", compressors.BF16, quantize_all_gather=True),
    )
}


class _Traffic:
    """Bytes a ring all-reduce of what a torch hook hands to dist.all_reduce puts on the wire."""

    def __init__(self) -> None:
        self.bytes = 0
        self._all_reduce = dist.all_reduce

    def __enter__(self) -> "_Traffic":
        n = dist.get_world_size()

        def counting(tensor, *args, **kwargs):
            self.bytes += ring_all_reduce_bytes(tensor.numel() * tensor.element_size(), n)
            return self._all_reduce(tensor, *args, **kwargs)

        dist.all_reduce = counting
        return self

    def __exit__(self, *exc) -> None:
        dist.all_reduce = self._all_reduce


def _plain_bytes(model: torch.nn.Module, steps: int) -> int:
    n = dist.get_world_size()
    numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return steps * ring_all_reduce_bytes(numel * 4, n)


def applies(method: Method, sharding: str) -> bool:
    """Whether `method` runs under `sharding` ("ddp" or "fsdp")."""
    if sharding == "ddp":
        return not method.quantize_all_gather
    return method.torch_hook is None and not method.hook_options


def _fully_shard(model: torch.nn.Module) -> torch.nn.Module:
    """``fully_shard`` on every child with parameters (inside lists and dicts of modules,
    which have no forward of their own), then on the root."""
    from torch.distributed.fsdp import fully_shard

    def shard_children(module: torch.nn.Module) -> None:
        for child in module.children():
            if not any(p.requires_grad for p in child.parameters()):
                continue
            if isinstance(child, (torch.nn.ModuleList, torch.nn.ModuleDict)):
                shard_children(child)
            else:
                fully_shard(child)

    shard_children(model)
    fully_shard(model)
    return model


def train(task: Task, method: Method, opt_name: str, seed: int, lr: Optional[float] = None,
          start_compress_iter: int = START_COMPRESS_ITER, sharding: str = "ddp",
          recipe: Optional[Recipe] = None) -> dict:
    """One run on every rank; returns the metric and the traffic figures. With ``recipe``
    (DDP only) its optimizer, learning rate, clipping and micro-batches replace ``opt_name``'s."""
    rank = dist.get_rank()
    lr = (recipe.lr if recipe else task.lr[opt_name]) if lr is None else lr
    torch.manual_seed(seed)
    model = task.model()
    if sharding == "fsdp":
        ddp = _fully_shard(model)
    else:
        ddp = DistributedDataParallel(model)
    family = optim if method.compressor is not None and method.direction and sharding == "ddp" else torch.optim
    # FSDP2 with a compressor: SGD's momentum, or Adam, moves into the compressed reduce-scatter
    # (what `direction` means there) and a plain SGD applies the averaged direction, unless the
    # method compresses gradients.
    in_comm = sharding == "fsdp" and method.compressor is not None and method.direction
    comm_momentum = method.sgd_momentum if in_comm and opt_name == "sgd" else 0.0
    adam_betas = ADAMW["betas"] if in_comm and opt_name == "adamw" else None
    if recipe is not None:
        options = dict(recipe.options)
        if recipe.optimizer == "sgd" and not method.sgd_momentum:  # DGC: the hook holds the momentum
            options.update(momentum=0.0, nesterov=False)
        opt = {"sgd": family.SGD, "adam": family.Adam, "adamw": family.AdamW}[recipe.optimizer](
            model.parameters(), lr=lr, **options)
    elif opt_name == "sgd":
        opt = family.SGD(model.parameters(), lr=lr, momentum=method.sgd_momentum - comm_momentum)
    elif adam_betas is not None:  # SGD's weight decay on a given direction is AdamW's decoupled one
        opt = torch.optim.SGD(model.parameters(), lr=lr, weight_decay=ADAMW["weight_decay"])
    else:
        opt = family.AdamW(model.parameters(), lr=lr, **ADAMW)
    state = None
    if sharding == "fsdp":
        if method.quantize_all_gather:
            fsdp.quantize_all_gather(model)
        if method.compressor is not None:
            state = fsdp.compress_gradients(model, method.compressor(), start_compress_iter=start_compress_iter,
                                            momentum=comm_momentum, adam_betas=adam_betas, adam_eps=ADAMW["eps"])
    elif method.compressor is not None:
        compressor = method.compressor()
        options = dict(method.hook_options)
        if recipe and recipe.clip and method.direction and not isinstance(compressor, (compressors.FP16, compressors.BF16)):
            options["max_grad_norm"] = recipe.clip  # .grad will hold directions: the hook clips
        state = hooks.CompressionState(compressor=compressor, start_compress_iter=start_compress_iter,
                                       optimizer=opt if method.direction else None, **options)
        ddp.register_comm_hook(state, hooks.compressed_hook)
    elif method.torch_hook == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif method.torch_hook == "powersgd":
        ddp.register_comm_hook(powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=4,
                                                           start_powerSGD_iter=start_compress_iter),
                               powerSGD_hook.powerSGD_hook)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(task.steps))
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    micro = recipe.micro_batches if recipe else 1
    # clip_grad_norm_ needs gradients in .grad: where the hook averages directions, it clips.
    clip = recipe.clip if recipe and getattr(state, "max_grad_norm", None) is None else None
    start = time.perf_counter()
    with _Traffic() as traffic:
        for _ in range(task.steps):
            opt.zero_grad()
            for m in range(micro):
                x, y = task.batch(g)
                with ddp.no_sync() if m < micro - 1 else contextlib.nullcontext():
                    task.loss(ddp, x, y).backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(ddp.parameters(), clip)
            opt.step()
            schedule.step()
    seconds = time.perf_counter() - start
    plain = _plain_bytes(model, task.steps)
    if sharding == "fsdp":  # what the reduce-scatters send, against a ring reduce-scatter (half an all-reduce)
        plain //= 2
    if state is not None:
        sent = state.stats.bytes_sent
        uncompressed = state.stats.bytes_uncompressed - state.stats.compressed_bytes_uncompressed
    elif method.torch_hook is not None:
        sent = traffic.bytes  # PowerSGD's warm-up all-reduces are counted there too
        uncompressed = plain * start_compress_iter // task.steps if method.torch_hook == "powersgd" else 0
    else:
        sent = uncompressed = plain
    return {"metric": task.evaluate(model), "reduction": plain / sent if sent else math.inf,
            "uncompressed_share": uncompressed / plain if plain else 0.0, "seconds": seconds,  # 1 rank: none
            "clipped": bool(clip) or getattr(state, "max_grad_norm", None) is not None}


def _cell(task: Task, values: list[float], baseline: Optional[list[float]]) -> tuple[str, Optional[bool]]:
    if not all(math.isfinite(v) for v in values):
        return f"diverged ({sum(not math.isfinite(v) for v in values)} of {len(values)} seeds)", False
    mean = statistics.fmean(values)
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    text = f"{mean:.2f} ± {sd:.2f}" if task.higher_is_better else f"{mean:.3f} ± {sd:.3f}"
    if baseline is None:
        return text, None
    base = statistics.fmean(baseline)
    if task.higher_is_better:
        delta = mean - base
        ok = delta >= -0.5
        return f"{text} ({delta:+.2f})", ok
    delta = (mean - base) / base * 100
    ok = delta <= 1.0
    return f"{text} ({delta:+.1f}%)", ok


def table(task: Task, results: dict) -> str:
    metric = "accuracy %" if task.higher_is_better else "validation loss, nats/char"
    head = f"| {task.name}: {metric} after {task.steps} steps, mean ± sd over seeds |"
    sep = "| --- |"
    for opt_name in OPTIMIZERS:
        head += f" {OPTIMIZER_LABELS[opt_name]}, lr {task.lr[opt_name]:g} | traffic ÷ |"
        sep += " --- | --- |"
    lines = [head, sep]
    for name in METHODS:
        row = f"| {name} |"
        present = False
        for opt_name in OPTIMIZERS:
            runs = results.get(opt_name, {}).get(name)
            if not runs:
                row += " - | - |"
                continue
            present = True
            baseline = None if name == "all-reduce" else [r["metric"] for r in results[opt_name].get("all-reduce", [])] or None
            text, ok = _cell(task, [r["metric"] for r in runs], baseline)
            goal = (METHODS[name].compressor is not None and METHODS[name].direction) or METHODS[name].quantize_all_gather
            mark = "" if ok is None or not goal else (" ✓" if ok else " ✗")
            reduction = statistics.fmean(r["reduction"] for r in runs)
            share = max(r["uncompressed_share"] for r in runs)
            traffic = "1.0x" if name == "all-reduce" else f"{reduction:.1f}x ({share:.1%} uncompressed)"
            row += f" {text}{mark} | {traffic} |"
        if present:
            lines.append(row)
    return "\n".join(lines)


RECIPE_METHODS = ("all-reduce", "fp16 (torch hook)", "PowerSGD rank 4 (torch hook)", "bf16", "1-bit", "ternary",
                  "top-k 1%", "random-k 10%", "top-k 1% DGC (hook momentum + clipping)")


def recipe_applies(method: Method, recipe: Recipe) -> bool:
    return ("sgd" if recipe.optimizer == "sgd" else "adamw") in method.optimizers and applies(method, "ddp")


def recipe_table(results: dict) -> str:
    """Methods by recipe: mean ± sd over seeds, the difference to all-reduce, ✓ within 0.5
    points or 1% of the loss, and the traffic reduction over the run."""
    names = [n for n in RECIPES if n in results]
    lines = ["| method | " + " | ".join(f"{n}: {RECIPES[n].label}" for n in names) + " |",
             "| --- |" + " --- |" * len(names)]
    for method in METHODS:
        row, present = f"| {method} |", False
        for name in names:
            runs = results[name].get(method)
            if not runs:
                row += " - |"
                continue
            present = True
            task = make_task(RECIPES[name].task)
            baseline = None if method == "all-reduce" else [r["metric"] for r in results[name].get("all-reduce", [])]
            text, ok = _cell(task, [r["metric"] for r in runs], baseline or None)
            mark = "" if ok is None else (" ✓" if ok else " ✗")
            unclipped = " (not clipped)" if RECIPES[name].clip and not all(r["clipped"] for r in runs) else ""
            row += f" {text}{mark}, {statistics.fmean(r['reduction'] for r in runs):.1f}x{unclipped} |"
        if present:
            lines.append(row)
    return "\n".join(lines)


def run_recipes(names: list[str], methods: list[str], seeds: int, start_compress_iter: int,
                steps: Optional[int]) -> dict:
    rank = dist.get_rank()
    results: dict = {}
    for name in names:
        recipe = RECIPES[name]
        task = make_task(recipe.task, **({"steps": steps} if steps else {}))
        for method in methods:
            if not recipe_applies(METHODS[method], recipe):
                continue
            runs = [train(task, METHODS[method], recipe.optimizer, s, start_compress_iter=start_compress_iter,
                          recipe=recipe) for s in range(seeds)]
            results.setdefault(name, {})[method] = runs
            if rank == 0:
                print(f"RESULT {name} {method}: " + json.dumps(runs), flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", default="mlp,cnn,lm", help="comma-separated tasks of bench.tasks")
    parser.add_argument("--optimizers", default=",".join(OPTIMIZERS), help="comma-separated: sgd, adamw")
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated names from the table")
    parser.add_argument("--seeds", type=int, default=3, help="seeds per cell (0, 1, ...)")
    parser.add_argument("--steps", type=int, default=None, help="override every task's step count")
    parser.add_argument("--start-compress-iter", type=int, default=START_COMPRESS_ITER,
                        help="uncompressed iterations first (every compressed method)")
    parser.add_argument("--sharding", choices=("ddp", "fsdp"), default="ddp",
                        help="DDP with hooks, or FSDP2 with ddlcomm.fsdp's compressed reduce-scatter")
    parser.add_argument("--sweep", action="store_true",
                        help="plain all-reduce at 0.5x, 1x and 2x each task's learning rate, to check it is the best")
    parser.add_argument("--recipes", default=None,
                        help=f"comma-separated recipes instead of tasks x optimizers ({', '.join(RECIPES)}, or all); "
                             f"writes recipes.md / recipes.json")
    parser.add_argument("--out", default=None, help="directory for convergence.md / convergence.json (rank 0)")
    parser.add_argument("--render", default=None, metavar="JSON",
                        help="print the tables of a saved convergence.json and exit (no training, no torchrun)")
    args = parser.parse_args()
    if args.render:
        report = json.loads(Path(args.render).read_text())
        if "recipes" in report:
            print(recipe_table(report["recipes"]))
            return
        for name, saved in report["tasks"].items():
            task = make_task(name)
            task.steps, task.lr = saved["steps"], saved["lr"]
            print(table(task, saved["results"]) + "\n")
        return
    # Asks the state the run will build whether it takes the warm-up (DDP's hook needs 2
    # iterations: its buckets are rebuilt after the first; PowerSGD's needs as many), so that a
    # refusal is one usage line here rather than a traceback from every rank's first train().
    try:
        if args.sharding == "ddp" or args.recipes:
            hooks.CompressionState(start_compress_iter=args.start_compress_iter)
        else:
            fsdp.FSDPCompressionState(compressors.OneBit(), args.start_compress_iter)
    except ValueError as e:
        parser.error(f"--start-compress-iter {args.start_compress_iter}: {e}")
    init_ranks("ddlcomm")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise SystemExit(f"unknown methods {unknown}; choose from {list(METHODS)}")
    if args.recipes:
        names = list(RECIPES) if args.recipes == "all" else args.recipes.split(",")
        if any(n not in RECIPES for n in names):
            raise SystemExit(f"unknown recipes {[n for n in names if n not in RECIPES]}; choose from {list(RECIPES)}")
        chosen = methods if args.methods != ",".join(METHODS) else list(RECIPE_METHODS)
        results = run_recipes(names, chosen, args.seeds, args.start_compress_iter, args.steps)
        if rank == 0:
            print("\n" + recipe_table(results) + "\n", flush=True)
            if args.out:
                out = Path(args.out)
                out.mkdir(parents=True, exist_ok=True)
                recipes = {n: vars(RECIPES[n]) for n in names}
                (out / "recipes.json").write_text(json.dumps({"world_size": dist.get_world_size(), "seeds": args.seeds,
                                                              "start_compress_iter": args.start_compress_iter,
                                                              "definitions": recipes, "recipes": results}, indent=1))
                (out / "recipes.md").write_text(recipe_table(results) + "\n")
        dist.destroy_process_group()
        return
    report: dict = {"world_size": dist.get_world_size(), "seeds": args.seeds, "sharding": args.sharding,
                    "start_compress_iter": args.start_compress_iter, "tasks": {}}
    tables = []
    for task_name in args.tasks.split(","):
        task = make_task(task_name, **({"steps": args.steps} if args.steps else {}))
        results: dict = {}
        for opt_name in args.optimizers.split(","):
            if args.sweep:
                for factor in (0.5, 1.0, 2.0):
                    lr = task.lr[opt_name] * factor
                    metrics = [train(task, METHODS["all-reduce"], opt_name, s, lr, sharding=args.sharding)["metric"]
                               for s in range(args.seeds)]
                    if rank == 0:
                        print(f"SWEEP {task.name} {opt_name} lr {lr:g}: {statistics.fmean(metrics):.3f} {metrics}", flush=True)
                continue
            for name in methods:
                if opt_name not in METHODS[name].optimizers or not applies(METHODS[name], args.sharding):
                    continue
                runs = [train(task, METHODS[name], opt_name, s, start_compress_iter=args.start_compress_iter,
                              sharding=args.sharding) for s in range(args.seeds)]
                results.setdefault(opt_name, {})[name] = runs
                if rank == 0:
                    print(f"RESULT {task.name} {opt_name} {name}: " + json.dumps(runs), flush=True)
        if not args.sweep:
            report["tasks"][task.name] = {"metric": task.metric, "steps": task.steps, "lr": task.lr, "results": results}
            tables.append(table(task, results))
            if rank == 0:
                print("\n" + tables[-1] + "\n", flush=True)
    if rank == 0 and args.out and tables:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "convergence.json").write_text(json.dumps(report, indent=1))
        (out / "convergence.md").write_text("\n\n".join(tables) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
