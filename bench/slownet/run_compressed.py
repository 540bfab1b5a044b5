"""Compressed all-reduce and DDP hooks on an emulated slow network, one run (or, with --module, another benchmark).

    sudo python -m bench.slownet.run_compressed --rates 1gbit,10gbit --out results

For each link rate it builds the emulated cluster of ddlcomm.slownet (one network
namespace per host, a bridge, every link shaped with tc; ``--ranks-per-host`` ranks in each), runs
``python -m bench.compressed`` on every rank, prints the tables, and writes
``slownet.json`` and ``slownet.png`` (time vs link bandwidth; with matplotlib, the plots extra) into --out.
Needs root and iproute2; exits non-zero with the reason when namespaces are unavailable.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ddlcomm.slownet import SlowNet

from bench.plots import pyplot, say_written
from bench.slownet.driver import bench_parser, collect_results, require_slownet, save_figure, worker_args


def run_rate(rate: str, hosts: int, extra: list[str], timeout: float, ranks_per_host: int = 1,
             delay: str = "0", module: str = "bench.compressed") -> list[dict]:
    with SlowNet(ranks=hosts, rate=rate, delay=delay) as net:
        results = collect_results(net, [sys.executable, "-m", module, *extra], timeout, rate, ranks_per_host)
    for record in results:
        record["rate"] = rate
        print(f"  [{rate}] {record['kind']:<9} {record['method']:<26} {record['seconds']:8.3f} s  "
              f"{record['speedup']:6.2f}x", flush=True)
    return results


def table(results: list[dict], kind: str) -> str:
    rates = sorted({r["rate"] for r in results}, key=lambda r: float(r.rstrip("gbitm") or 0))
    methods = list(dict.fromkeys(r["method"] for r in results if r["kind"] == kind))
    lines = [f"| {kind} | " + " | ".join(f"{rate}: s (speed-up vs first)" for rate in rates) + " | bytes on the wire per rank |",
             "| --- |" + " --- |" * (len(rates) + 1)]
    for m in methods:
        cells = []
        wire = ""
        for rate in rates:
            rec = next((r for r in results if r["kind"] == kind and r["method"] == m and r["rate"] == rate), None)
            cells.append(f"{rec['seconds']:.3f} ({rec['speedup']:.1f}x)" if rec else "-")
            if rec and rec.get("wire_bytes") is not None:
                wire = f"{rec['wire_bytes'] / 1e6:.1f} MB"
        lines.append(f"| {m} | " + " | ".join(cells) + f" | {wire or 'n/a'} |")
    return "\n".join(lines)


def plot(results: list[dict], path: Path) -> bool:
    """The all-reduce and DDP panels of what ran; False (nothing written) where neither ran
    or matplotlib is not installed."""
    def gbits(rate: str) -> float:
        value = float(rate.rstrip("gbitm"))
        return value if rate.endswith("gbit") else value / 1000

    # Titles from what ran (--numel, --width/--depth, --ranks); a kind that did not run
    # (--skip-ddp) gets no panel.
    first = {kind: next((r for r in results if r["kind"] == kind), None) for kind in ("allreduce", "ddp")}
    panels = []
    if first["allreduce"]:
        r = first["allreduce"]
        panels.append(("allreduce", f"all-reduce of {r.get('numel', 0) * 4 / 1e6:.0f} MB float32, "
                                    f"{r.get('ranks', '?')} ranks"))
    if first["ddp"]:
        panels.append(("ddp", f"DDP iteration, {first['ddp'].get('params', 0) / 1e6:.1f}M-parameter model"))
    if not panels:
        return False
    plt = pyplot(path)
    if plt is None:
        return False
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), squeeze=False)
    for ax, (kind, title) in zip(axes[0], panels):
        for method in dict.fromkeys(r["method"] for r in results if r["kind"] == kind):
            points = sorted((gbits(r["rate"]), r["seconds"]) for r in results if r["kind"] == kind and r["method"] == method)
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=method)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("link bandwidth (Gbit/s)")
        ax.set_ylabel("seconds")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    save_figure(fig, path)
    return True


def main() -> None:
    parser = bench_parser(__doc__, "results", 1500, worker="bench.compressed")
    parser.add_argument("--ranks", type=int, default=4, help="emulated hosts")
    parser.add_argument("--ranks-per-host", type=int, default=1, help="ranks in each host (shared memory between them)")
    parser.add_argument("--delay", default="0", help="one-way delay of every link (tc syntax, e.g. 20ms)")
    parser.add_argument("--module", default="bench.compressed",
                        help="the benchmark every rank runs (also bench.adaptive_paired)")
    args = parser.parse_args()
    require_slownet("bench.slownet.run_compressed")
    extra = worker_args(args)
    results: list[dict] = []
    for rate in args.rates.split(","):
        results += run_rate(rate, args.ranks, extra, args.timeout, args.ranks_per_host, args.delay, args.module)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "slownet.json").write_text(json.dumps(results, indent=1))
    for kind in dict.fromkeys(r["kind"] for r in results):
        print()
        print(table(results, kind))
    print()
    say_written([out / "slownet.json"], out / "slownet.png", plot(results, out / "slownet.png"))


if __name__ == "__main__":
    main()
