"""Time to accuracy on an emulated slow network: 4 ranks, each a host of ddlcomm.slownet.

    sudo python -m bench.slownet.run_time_to_accuracy --rates 1gbit,10gbit --out docs/results

For each link rate and each task (the CNN with SGD and the transformer language model with
AdamW, from bench.tasks, sized so that communication matters) it runs
``python -m bench.time_to_accuracy`` on every rank, then reports for each method the
training time until the metric reaches a target: within 0.5 points of gloo fp32's final
accuracy or 1% of its final loss, and a looser 1 point / 2%. Writes ``time_to_accuracy.json``,
``time_to_accuracy.md`` and ``time_to_accuracy.png`` (metric against wall time; with matplotlib, the plots
extra) into --out.
Needs root and iproute2; exits non-zero with the reason when namespaces are unavailable.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ddlcomm.slownet import SlowNet

from bench.plots import pyplot, say_written
from bench.slownet.driver import bench_parser, collect_results, require_slownet, save_figure

# (task, optimizer, worker options): the CNN's first linear layer is wide (8.4M parameters,
# nearly all in that layer, as in VGG-style networks) so that a step at 1 Gbit/s is mostly
# communication; lr 0.03 is the better of 0.03 and 0.1 for it with gloo fp32. The language
# model is the convergence benchmark's.
RUNS = [
    ("cnn", "sgd", ["--width", "8192", "--batch", "16", "--lr", "0.03", "--steps", "300", "--eval-every", "20"]),
    ("lm", "adamw", ["--steps", "300", "--eval-every", "30"]),
]


def run_rate(rate: str, delay: str, runs: list, methods: str, timeout: float, extra: list[str],
             ranks_per_host: int = 1) -> list[dict]:
    """Every run of ``runs`` on one emulated network of 4 ranks (``ranks_per_host`` in each
    host); ``rate`` names it in the tables (with the delay and the hosts when they matter)."""
    results: list[dict] = []
    name = rate if delay in ("0", "0ms") else f"{rate} {delay}"
    if ranks_per_host > 1:
        name += f", {4 // ranks_per_host} hosts x {ranks_per_host}"
    with SlowNet(ranks=4 // ranks_per_host, rate=rate, delay=delay) as net:
        for task, opt_name, options in runs:
            argv = [sys.executable, "-m", "bench.time_to_accuracy", "--task", task, "--optimizer", opt_name,
                    "--methods", methods, "--ranks-per-host", str(ranks_per_host), *options, *extra]
            for record in collect_results(net, argv, timeout, f"{task} at {name}", ranks_per_host):
                record["rate"] = name
                results.append(record)
                share = compute_share(record)
                print(f"  [{rate}] {task:<4} {record['method']:<30} {record['seconds_per_step']:.3f} s/step, "
                      f"final {record['curve'][-1][2]:.3f}" + (f", compute {share:.0%}" if share else ""), flush=True)
    return results


def compute_share(record: dict) -> float | None:
    """DiLoCo: the ranks' mean share of their training time not spent waiting for averages
    (in ``DiLoCo.step()``, and in a warm-up step's ``optimizer.step()``)."""
    ranks = record.get("rank_seconds")
    return sum(1 - waited / clock for clock, waited in ranks) / len(ranks) if ranks else None


def time_to_target(record: dict, target: float, higher: bool) -> float | None:
    for seconds, _, metric in record["curve"]:
        if (metric >= target) if higher else (metric <= target):
            return seconds
    return None


def summarise(results: list[dict], points: float = 0.5, loss_pct: float = 1.0) -> tuple[str, dict]:
    """Markdown tables of seconds per step and time to the target: ``points`` below gloo fp32's
    final accuracy, or ``loss_pct`` percent above its final loss."""
    lines, summary = [], {}
    for task in dict.fromkeys(r["task"] for r in results):
        rates = list(dict.fromkeys(r["rate"] for r in results if r["task"] == task))
        higher = next(r for r in results if r["task"] == task)["metric"] == "accuracy"
        lines += [f"| {task} | " + " | ".join(f"{rate}: s/step | {rate}: time to target (speed-up vs gloo fp32)" for rate in rates)
                  + " | final metric |", "| --- |" + " --- | --- |" * len(rates) + " --- |"]
        targets = {}
        for rate in rates:
            base = next(r for r in results if r["task"] == task and r["rate"] == rate and r["method"] == "gloo fp32")
            final = base["curve"][-1][2]
            targets[rate] = final - points if higher else final * (1 + loss_pct / 100)
        for method in dict.fromkeys(r["method"] for r in results if r["task"] == task):
            cells, finals = [], []
            for rate in rates:
                rec = next((r for r in results if r["task"] == task and r["rate"] == rate and r["method"] == method), None)
                if rec is None:
                    cells.append("- | -")
                    continue
                base = next(r for r in results if r["task"] == task and r["rate"] == rate and r["method"] == "gloo fp32")
                t, t0 = time_to_target(rec, targets[rate], higher), time_to_target(base, targets[rate], higher)
                summary[(task, rate, method)] = t
                speed = f"{t:.1f} s ({t0 / t:.2f}x)" if t and t0 else ("not reached" if t is None else f"{t:.1f} s")
                cells.append(f"{rec['seconds_per_step']:.3f} | {speed}")
                finals.append(f"{rec['curve'][-1][2]:.3f}")
            lines.append(f"| {method} | " + " | ".join(cells) + f" | {' / '.join(finals)} |")
        target_text = ", ".join(f"{rate}: {'>=' if higher else '<='} {targets[rate]:.3f}" for rate in rates)
        rule = f"{points:g} points below" if higher else f"{loss_pct:g}% above"
        lines += [f"\nTarget ({task}, {rule} gloo fp32's final figure): {target_text}.\n"]
    return "\n".join(lines), summary


def report(results: list[dict]) -> str:
    """Both targets: the goal's (0.5 points / 1%), which one seed's noise can decide, and a
    looser one (1 point / 2%) that every method reaches."""
    runs = {(r["task"], r["rate"]) for r in results}
    missing = sorted(runs - {(r["task"], r["rate"]) for r in results if r["method"] == "gloo fp32"})
    if missing:
        return (f"no 'gloo fp32' run for {missing}: the targets are set from it (run it too, or merge the "
                f"records into a saved time_to_accuracy.json and --render that)")
    strict, _ = summarise(results, 0.5, 1.0)
    loose, _ = summarise(results, 1.0, 2.0)
    return f"{strict}\n\n{loose}"


def plot(results: list[dict], path: Path) -> bool:
    """Metric against training seconds, a panel per task and rate; False (nothing written)
    without matplotlib."""
    plt = pyplot(path)
    if plt is None:
        return False
    panels = list(dict.fromkeys((r["task"], r["rate"]) for r in results))
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2), squeeze=False)
    for ax, (task, rate) in zip(axes[0], panels):
        for rec in (r for r in results if r["task"] == task and r["rate"] == rate):
            ax.plot([c[0] for c in rec["curve"]], [c[2] for c in rec["curve"]], marker=".", label=rec["method"])
        metric = next(r for r in results if r["task"] == task)["metric"]
        ax.set_title(f"{task}, 4 ranks, {rate}")
        ax.set_xlabel("training seconds")
        ax.set_ylabel("test accuracy %" if metric == "accuracy" else "validation loss")
        if metric == "accuracy":
            ax.set_ylim(80, 100)
        else:  # from the best final loss to a quarter above it (or above the worst final one)
            finals = [r["curve"][-1][2] for r in results if r["task"] == task and r["rate"] == rate]
            ax.set_ylim(min(finals) * 0.98, max(min(finals) * 1.25, max(finals) * 1.08))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    save_figure(fig, path)
    return True


def main() -> None:
    parser = bench_parser(__doc__, "docs/results", 3600)
    parser.add_argument("--tasks", default="cnn,lm", help="comma-separated tasks of bench.tasks")
    parser.add_argument("--methods", default=None, help="passed to the worker (default: all)")
    parser.add_argument("--ranks-per-host", type=int, choices=(1, 2, 4), default=1,
                        help="ranks in each emulated host (4 ranks in all): 2 makes 2 hosts of 2")
    parser.add_argument("--delay", default="0", help="one-way delay of every link (tc syntax, e.g. 20ms)")
    parser.add_argument("--sync-every", type=int, default=None, help="passed to the worker (DiLoCo's inner steps)")
    parser.add_argument("--steps", type=int, default=None, help="passed to the worker instead of each task's steps")
    parser.add_argument("--seed", type=int, default=None, help="passed to the worker (initial weights and batches)")
    for flag in ("--outer-lr", "--outer-momentum", "--warmup-steps"):
        parser.add_argument(flag, default=None, help="passed to the worker (DiLoCo's outer settings)")
    parser.add_argument("--warmup-compressed", action="store_true",
                        help="passed to the worker (DiLoCo's warm-up through the method's compressor)")
    parser.add_argument("--render", default=None, metavar="JSON",
                        help="rewrite the .md and .png beside a saved time_to_accuracy.json, print the tables and exit")
    args = parser.parse_args()
    if args.render:
        saved = Path(args.render)
        results = json.loads(saved.read_text())
        write_report(results, saved.parent)
        return
    from bench.time_to_accuracy import METHODS, check_methods

    methods = args.methods or ",".join(METHODS)
    check_methods(methods.split(","))  # before any namespace is made
    require_slownet("bench.slownet.run_time_to_accuracy")
    runs = [r for r in RUNS if r[0] in args.tasks.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: list[dict] = []
    for rate in args.rates.split(","):
        passed = {"--sync-every": args.sync_every, "--steps": args.steps, "--seed": args.seed, "--outer-lr": args.outer_lr,
                  "--outer-momentum": args.outer_momentum, "--warmup-steps": args.warmup_steps}
        extra = [str(v) for flag, value in passed.items() if value is not None for v in (flag, value)]
        extra += ["--warmup-compressed"] if args.warmup_compressed else []
        results += run_rate(rate, args.delay, runs, methods, args.timeout, extra, args.ranks_per_host)
        # Saved after each rate: an interrupted run keeps what it measured (--render reads it).
        (out / "time_to_accuracy.json").write_text(json.dumps(results, indent=1))
    write_report(results, out)


def write_report(results: list[dict], out: Path) -> None:
    text = report(results)
    (out / "time_to_accuracy.md").write_text(text + "\n")
    print("\n" + text, flush=True)
    say_written([out / "time_to_accuracy.md"], out / "time_to_accuracy.png",
                plot(results, out / "time_to_accuracy.png"))


if __name__ == "__main__":
    main()
