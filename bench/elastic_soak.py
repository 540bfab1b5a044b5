"""Elastic soak: the compressed training paths under torchrun --max-restarts, with ranks killed
and the job resumed from checkpoints, over and over for a given time.

    .venv/bin/python -m bench.elastic_soak [--minutes 30] [--json out.json] [--paths ddp-onebit,...]

Each cycle runs every path (DDP with the 1-bit, ternary, top-k and fp16 hooks; FSDP2 with
1-bit) of tests/workers/elastic.py on 4 ranks for 40 steps, with two ranks killed (os._exit(9))
in the first two attempts; torchrun restarts the job and it resumes from the newest step every
rank saved. A cycle passes when the job exits 0 after exactly three attempts and its final
parameters equal, bitwise, an uninterrupted run's (no step lost or repeated; the replicas'
parameters are gathered from every rank). It prints a Markdown summary: runs, restarts, each
path's wall time, the ranks' RSS at their checkpoints (first and last cycle), and what was
left in /dev/shm. Exits non-zero on any failed cycle. The worker is a test: it runs from a
source checkout, not from a wheel.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

WORKER = Path(__file__).resolve().parents[1] / "tests" / "workers" / "elastic.py"
PATHS = ["ddp-onebit", "ddp-ternary", "ddp-topk", "ddp-fp16", "fsdp-onebit"]
STEPS, KILL_AT, KILLS = 40, 7, 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(folder: Path, path: str, kills: int) -> tuple[subprocess.CompletedProcess, torch.Tensor | None, float]:
    folder.mkdir()
    result = folder / "result.pt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--max-restarts", str(kills),
           "--monitor-interval", "0.1", "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
           str(WORKER), str(folder), str(result), str(STEPS), str(KILL_AT if kills else -1), path]
    env = {**os.environ, "ELASTIC_KILLS": str(kills), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    start = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    return done, (torch.load(result) if result.exists() else None), time.monotonic() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=30, help="how long to keep starting killed-and-resumed runs")
    parser.add_argument("--json", help="also write the figures here")
    parser.add_argument("--paths", default=",".join(PATHS),
                        help=f"comma-separated training paths to cycle through (default: all, {','.join(PATHS)})")
    args = parser.parse_args()
    paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    unknown = [p for p in paths if p not in PATHS]
    if unknown or not paths:
        parser.error(f"--paths: no path {unknown}; the paths: {','.join(PATHS)}")
    if not WORKER.is_file():
        raise SystemExit(f"elastic_soak: {WORKER} not found: run it from a source checkout")
    shm_before = set(os.listdir("/dev/shm"))
    deadline = time.monotonic() + args.minutes * 60
    reference: dict[str, torch.Tensor] = {}
    rows: list[dict] = []
    failures: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        cycle = 0
        while time.monotonic() < deadline and not failures:
            for path in paths:
                if path not in reference:
                    done, params, _ = _run(Path(tmp) / f"{path}-straight", path, 0)
                    if done.returncode != 0 or params is None:
                        failures.append(f"{path}: the uninterrupted run failed: {done.stderr[-2000:]}")
                        break
                    reference[path] = params
                done, params, seconds = _run(Path(tmp) / f"{path}-{cycle}", path, KILLS)
                attempts = sorted({int(a) for a in re.findall(r"attempt (\d+): from step", done.stdout)})
                rss = [float(m) for m in re.findall(r"rss ([\d.]+) MiB", done.stdout)]
                ok = done.returncode == 0 and attempts == [0, 1, 2] and params is not None \
                    and torch.equal(params, reference[path])
                rows.append({"cycle": cycle, "path": path, "ok": ok, "seconds": round(seconds, 1),
                             "attempts": len(attempts), "rss_mib_max": max(rss, default=0.0),
                             "rss_mib_min": min(rss, default=0.0)})
                print(f"cycle {cycle} {path}: {'ok' if ok else 'FAILED'} in {seconds:.1f} s, attempts {attempts}, "
                      f"RSS {min(rss, default=0):.0f}-{max(rss, default=0):.0f} MiB", flush=True)
                if not ok:
                    failures.append(f"cycle {cycle} {path}: exit {done.returncode}, attempts {attempts}, equal "
                                    f"{params is not None and torch.equal(params, reference[path])}\n"
                                    f"{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
                    break
            cycle += 1
    left = sorted(set(os.listdir("/dev/shm")) - shm_before)
    print("\n| path | runs | restarts | passed | seconds per run (min-max) | RSS MiB, first cycle | RSS MiB, last cycle |")
    print("| --- | ---: | ---: | ---: | --- | --- | --- |")
    for path in paths:
        mine = [r for r in rows if r["path"] == path]
        if not mine:
            continue
        secs = [r["seconds"] for r in mine]
        print(f"| {path} | {len(mine)} | {sum(r['attempts'] - 1 for r in mine)} | {sum(r['ok'] for r in mine)} | "
              f"{min(secs)}-{max(secs)} | {mine[0]['rss_mib_min']:.0f}-{mine[0]['rss_mib_max']:.0f} | "
              f"{mine[-1]['rss_mib_min']:.0f}-{mine[-1]['rss_mib_max']:.0f} |")
    print(f"\n{len(rows)} runs in {cycle} cycles, {sum(r['ok'] for r in rows)} passed; left in /dev/shm: {left or 'nothing'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"minutes": args.minutes, "steps": STEPS, "kills_per_run": KILLS, "paths": paths, "rows": rows,
                       "dev_shm_left": left, "failures": failures}, f, indent=1)
    for failure in failures:
        print(failure, file=sys.stderr)
    return 1 if failures or not rows else 0


if __name__ == "__main__":
    sys.exit(main())
