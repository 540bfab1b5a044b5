"""Which outer learning rate and momentum hold across recipes? ``bench.diloco`` over a grid.

    python -m bench.outer_steps --out docs/results/outer_steps            # runs, then renders
    python -m bench.outer_steps --out docs/results/outer_steps --render   # renders what is there

For each recipe of ``bench.convergence.RECIPES`` named by ``--recipes`` and each (outer lr,
outer momentum) of ``--settings``, runs ``torchrun --nproc-per-node 4 -m bench.diloco`` (4
one-rank replicas, outer Nesterov SGD every ``--sync-every`` inner steps, float32 and ternary
pseudo-gradients, ``--seeds`` seeds, the DDP row on the same seeds) into
``OUT/<recipe>-lr<lr>-m<momentum>/diloco.json``, skipping runs already there. Then writes
``OUT/README.md``: one table per recipe, a row per setting, each cell the mean ± sd of the
metric and its distance to DDP's, plus the traffic saved against DDP's float32 all-reduce.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Optional

from bench.convergence import RECIPES as CONVERGENCE_RECIPES
from bench.tasks import make_task

RECIPES = "gru-adam,cnn-adam,lm-adamw-clip,mlp-nesterov"
SETTINGS = "0.7:0.9,0.7:0.5,0.5:0.8,1.0:0.0,1.0:0.3,1.0:0.5,1.0:0.7,1.3:0.5"
METHODS = ("DiLoCo fp32", "DiLoCo ternary")


def run_dir(out: Path, recipe: str, lr: float, momentum: float) -> Path:
    return out / f"{recipe}-lr{lr:g}-m{momentum:g}"


def run(out: Path, recipe: str, lr: float, momentum: float, seeds: int, sync_every: int,
        steps: Optional[int] = None) -> None:
    where = run_dir(out, recipe, lr, momentum)
    if (where / "diloco.json").exists():
        return
    print(f"== {recipe}: outer lr {lr:g}, momentum {momentum:g}", flush=True)
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                    "-m", "bench.diloco", "--recipe", recipe, "--methods", ";".join(METHODS), "--seeds", str(seeds),
                    "--sync-every", str(sync_every), "--outer-lr", str(lr), "--outer-momentum", str(momentum),
                    "--out", str(where), *(["--steps", str(steps)] if steps else [])], check=True)


def cell(values: list[float], base: float, higher_is_better: bool) -> str:
    mean = statistics.fmean(values)
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    if higher_is_better:
        return f"{mean:.2f} ± {sd:.2f} ({mean - base:+.2f})"
    return f"{mean:.3f} ± {sd:.3f} ({(mean - base) / base * 100:+.1f}%)"


def render(out: Path, recipes: list[str], settings: list[tuple[float, float]], command: str) -> str:
    lines = ["# Outer learning rate and momentum across recipes", "",
             f"Made by `{command}` (bench/outer_steps.py): 4 one-rank replicas, outer Nesterov SGD, "
             "each cell the mean ± sd over the seeds and the distance to DDP's mean on the same seeds "
             "(accuracy: points; loss: %). Traffic saved against DDP's float32 all-reduce at every step.", ""]
    for recipe in recipes:
        runs = {s: json.loads((run_dir(out, recipe, *s) / "diloco.json").read_text())
                for s in settings if (run_dir(out, recipe, *s) / "diloco.json").exists()}
        if not runs:
            continue
        first = next(iter(runs.values()))
        ddp = [r["metric"] for r in first["results"]["DDP all-reduce"]]
        higher = make_task(CONVERGENCE_RECIPES[recipe].task).higher_is_better
        base = statistics.fmean(ddp)
        ddp_text = f"{base:.2f}" if higher else f"{base:.3f}"
        traffic = {m: statistics.fmean(r["reduction"] for r in first["results"][m]) for m in METHODS}
        lines += [f"## {recipe}: DDP {'accuracy' if higher else 'validation loss'} {ddp_text}, "
                  f"{len(ddp)} seeds, outer steps every {first['sync_every']}", "",
                  "| outer lr | outer momentum | " + " | ".join(f"{m} ({traffic[m]:.0f}x less traffic)"
                                                            for m in METHODS) + " |",
                  "| --- | --- | " + " | ".join("---" for _ in METHODS) + " |"]
        for (lr, momentum), data in runs.items():
            cells = [cell([r["metric"] for r in data["results"][m]], base, higher) for m in METHODS]
            lines.append(f"| {lr:g} | {momentum:g} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipes", default=RECIPES, help="comma-separated recipes of bench.convergence")
    parser.add_argument("--settings", default=SETTINGS, help="comma-separated outer lr:momentum pairs")
    parser.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 per run")
    parser.add_argument("--sync-every", type=int, default=10, help="inner steps between outer steps (H)")
    parser.add_argument("--steps", type=int, default=None, help="inner steps (default: each task's)")
    parser.add_argument("--out", type=Path, required=True, help="directory of the runs and of README.md")
    parser.add_argument("--render", action="store_true", help="only render the runs already in --out")
    args = parser.parse_args()
    recipes = args.recipes.split(",")
    settings = [(float(lr), float(m)) for lr, m in (s.split(":") for s in args.settings.split(","))]
    if not args.render:
        for recipe in recipes:
            for lr, momentum in settings:
                run(args.out, recipe, lr, momentum, args.seeds, args.sync_every, args.steps)
    command = f"python -m bench.outer_steps --out {args.out}"
    if args.recipes != RECIPES:
        command += f" --recipes {args.recipes}"
    if args.settings != SETTINGS:
        command += f" --settings {args.settings}"
    text = render(args.out, recipes, settings, command)
    (args.out / "README.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
