"""What the benchmark drivers of the emulated network (run_compressed, run_fsdp_step,
run_time_to_accuracy) share: their options, the check that namespaces work here, running a
``bench`` worker on every rank (bench/ found through PYTHONPATH) and collecting rank 0's
``RESULT {json}`` lines, and saving a figure."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from ddlcomm.slownet import SlowNet

# The repository root, bench/'s parent: the ranks start in "/", where `-m bench.X` finds
# bench/ only through PYTHONPATH.
ROOT = Path(__file__).resolve().parents[2]


def bench_parser(doc: str, out: str, timeout: float, worker: str | None = None) -> argparse.ArgumentParser:
    """The options every emulated-network benchmark takes: link rates, output folder, timeout,
    and (with ``worker``) the options after ``--`` that go to that worker (``worker_args``)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", default="1gbit,10gbit", help="comma-separated link rates to emulate (tc syntax)")
    parser.add_argument("--out", default=out, help="folder for the .md and .json results")
    parser.add_argument("--timeout", type=float, default=timeout, help="seconds before a run is killed")
    if worker:
        parser.add_argument("worker_args", nargs=argparse.REMAINDER, help=f"passed to {worker} after --",
                            type=str)
    return parser


def worker_args(args: argparse.Namespace) -> list[str]:
    """The options given after ``--`` (see bench_parser)."""
    return [a for a in args.worker_args if a != "--"]


def require_slownet(name: str) -> None:
    """Exits with status 2 and the reason when network namespaces are unavailable."""
    ok, reason = SlowNet.available()
    if not ok:
        print(f"{name}: cannot emulate a network here: {reason}", file=sys.stderr)
        raise SystemExit(2)


def collect_results(net: SlowNet, argv: list[str], timeout: float, what: str, ranks_per_host: int = 1) -> list[dict]:
    """Runs ``argv`` ``ranks_per_host`` times in every host (namespace) of ``net``, as torchrun
    numbers ranks (a host's consecutively); returns the ``RESULT {json}`` lines rank 0 printed.
    With several ranks per host ddlcomm's transport is ``auto`` (shared memory inside a host,
    TCP between) unless DDLCOMM_TRANSPORT says otherwise. Raises SystemExit with rank 0's
    output when a rank fails."""
    procs = []
    world = net.ranks * ranks_per_host
    for rank in range(world):
        host, local = divmod(rank, ranks_per_host)
        env = net.env(host, 29500)
        env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", RANK=str(rank), WORLD_SIZE=str(world),
                   LOCAL_RANK=str(local), LOCAL_WORLD_SIZE=str(ranks_per_host))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
        if ranks_per_host > 1 and "DDLCOMM_TRANSPORT" not in os.environ:
            env["DDLCOMM_TRANSPORT"] = "auto"
        # rank 0 reports; the others stay quiet unless they fail
        procs.append(net.popen(host, argv, env=env, stdout=subprocess.PIPE if rank == 0 else subprocess.DEVNULL,
                               stderr=subprocess.STDOUT if rank == 0 else None, cwd="/"))
    deadline = time.monotonic() + timeout
    out, _ = procs[0].communicate(timeout=max(1, deadline - time.monotonic()))
    for proc in procs[1:]:
        proc.wait(timeout=max(1, deadline - time.monotonic()))
    if any(p.returncode for p in procs):
        print(out.decode()[-3000:], file=sys.stderr)
        raise SystemExit(f"a rank failed ({what}): exit codes {[p.returncode for p in procs]}")
    return [json.loads(line[len("RESULT "):]) for line in out.decode().splitlines() if line.startswith("RESULT ")]


def save_figure(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
