"""Long soak: thousands of random collectives on 4 ranks, sizes up to 64 MiB, every result
checked against a reference (tests/workers/soak.py; tests/test_soak.py runs a short one in CI).

    .venv/bin/python -m bench.soak                          # the run in docs/results/soak.md
    .venv/bin/python -m bench.soak --ops 2000 --max-mib 16 --seed 3

Starts the ranks through the test harness (tests/harness.py: env:// rendezvous on loopback)
and prints a Markdown summary: operations per kind, mismatches, wall time and each rank's
RSS after the warm-up, at its peak and at the end. Exits non-zero if any rank failed (a
mismatch, an error, a hang past --timeout or RSS growth past the worker's bound). The harness
and the worker are tests: it runs from a source checkout (installed editable, as
``scripts/setup.sh`` does), not from a wheel.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import os
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

MiB = 1 << 20
HARNESS = Path(__file__).resolve().parents[1] / "tests" / "harness.py"


def load(name: str, path: Path) -> ModuleType:
    """The module at ``path`` of the checkout this module lies in, imported by its path (the
    harness and the worker are tests; an installed wheel has neither)."""
    if not path.is_file():
        raise SystemExit(f"soak: {path} not found: the soak runs the test harness and "
                         "tests/workers/soak.py of a source checkout (install it editable)")
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before it runs: dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@functools.cache
def load_harness() -> ModuleType:
    """tests/harness.py."""
    return load("harness", HARNESS)


@functools.cache
def warmup_ops() -> int:
    """The operations of the worker's warm-up, the fewest a run can have: every kind but the
    compressed all-reduce, then that once per compressor (tests/workers/soak.py Soak.run). The
    RSS growth the run is judged by is measured from the warm-up's end."""
    workers = load_harness().WORKERS
    sys.path.insert(0, str(workers))  # as a rank runs it: it imports its neighbours by name
    worker = load("soak_worker", workers / "soak.py")
    return len(worker.KINDS) - 1 + len(worker.COMPRESSORS)


def markdown(args: argparse.Namespace, results: list[Any], wall: float, passed: bool) -> str:
    """The report: ``results`` are the ranks' harness.RankResult."""
    ranks = [s for s in map(load_harness().soak_summary, results) if s is not None]
    command = (f"python -m bench.soak --ops {args.ops} --seed {args.seed} --max-mib {args.max_mib} "
               f"--ranks {args.ranks}")
    out = [
        f"`{command}` on {os.cpu_count()} cores, {time.strftime('%Y-%m-%d')}: "
        f"{'passed' if passed else 'FAILED'} in {wall:.0f} s wall "
        f"(load average {os.getloadavg()[0]:.1f} at the end).",
        "",
    ]
    if ranks:
        kinds = ranks[0]["kinds"]
        out += ["| kind | operations |", "| --- | --- |"]
        out += [f"| {kind} | {count} |" for kind, count in sorted(kinds.items(), key=lambda kv: -kv[1])]
        out += [f"| **all** | **{sum(kinds.values())}** |", ""]
        out += ["| rank | mismatches | seconds | buffer GiB | RSS after warm-up MiB | peak MiB | end MiB "
                "| growth MiB | VmHWM MiB |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for s in ranks:
            out.append(f"| {s['rank']} | {s['mismatches']} | {s['seconds']:.0f} | {s['buffer_bytes'] / 2**30:.1f} "
                       f"| {s['rss_warm_mib']:.0f} | {s['rss_peak_mib']:.0f} | {s['rss_end_mib']:.0f} "
                       f"| {s['rss_end_mib'] - s['rss_warm_mib']:+.0f} | {s['vm_hwm_mib']:.0f} |")
        points = len(ranks[0]["rss_trace_mib"])
        every = max(1, args.ops // 10)  # the worker's sampling interval (tests/workers/soak.py Soak.run)
        out += ["", "RSS in MiB after each tenth of the operations:", "",
                "| rank | " + " | ".join(f"{every * (i + 1)}" for i in range(points)) + " |",
                "| --- " * (points + 1) + "|"]
        out += [f"| {s['rank']} | " + " | ".join(str(v) for v in s["rss_trace_mib"]) + " |" for s in ranks]
    return "\n".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ops", type=int, default=10_000,
                        help="random collectives to run and check, at least the warm-up (each kind, compressor once)")
    parser.add_argument("--seed", type=int, default=2026, help="seed of the random sequence (every rank draws the same)")
    parser.add_argument("--max-mib", type=float, default=64, help="largest buffer a rank passes, in MiB")
    parser.add_argument("--ranks", type=int, default=4, help="ranks to start")
    parser.add_argument("--timeout", type=float, default=4 * 3600, help="seconds before the ranks are killed")
    args = parser.parse_args()
    if args.ops < warmup_ops():
        parser.error(f"--ops {args.ops}: the soak runs at least {warmup_ops()} operations: its warm-up runs every "
                     "kind and every compressor once, and RSS growth is measured from its end")
    start = time.monotonic()
    harness = load_harness()
    results = harness.launch_script(harness.WORKERS / "soak.py", args.ranks, timeout=args.timeout,
                                    args=("soak", str(args.ops), str(args.seed), str(int(args.max_mib * MiB))))
    wall = time.monotonic() - start
    for r in results:
        if r.returncode != 0:
            print(f"--- rank {r.rank} (exit {r.returncode}) ---\n{r.output[-6000:]}", file=sys.stderr)
    passed = all(r.returncode == 0 for r in results)
    print(markdown(args, results, wall, passed))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
