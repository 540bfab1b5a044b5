"""Multi-process test harness: starts N ranks directly (env:// rendezvous on loopback),
each running a scenario from tests/workers/, and reports every rank's exit code and output.

Ranks are started directly rather than through torchrun so that a test sees what each
surviving rank does after another fails (torchrun's agent would kill them all). As under
torchrun, the TCPStore lives outside the ranks (here, in the test process), so it
outlives any rank that dies.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

WORKERS = Path(__file__).parent / "workers"


def transports() -> list[str]:
    """The DDLCOMM_TRANSPORT values to run transport-matrix tests over: tcp, shm, and ucx (over
    UCX's tcp transport) in a build with UCX. test_ucx.py adds UCX's shared memory."""
    import ddlcomm

    return ["tcp", "shm"] + (["ucx"] if "ucx" in ddlcomm.transports() else [])


def transport_env(transport: str) -> dict[str, str]:
    """The rank environment that selects `transport` (a value of transports())."""
    if transport == "ucx":
        return {"DDLCOMM_TRANSPORT": "ucx", "UCX_TLS": "tcp,self"}
    return {"DDLCOMM_TRANSPORT": transport}


# Set for every rank, besides the rendezvous variables.
RANK_ENV = {
    "OMP_NUM_THREADS": "1",
    "PYTHONUNBUFFERED": "1",
    "TORCHELASTIC_USE_AGENT_STORE": "True",  # ranks are clients of a store outside them
}


@dataclass
class RankResult:
    rank: int
    returncode: int
    output: str
    seconds: float


def launch(
    worker: str,
    scenario: str,
    world_size: int,
    timeout: float = 120.0,
    env: dict[str, str] | None = None,
    rank_env: dict[int, dict[str, str]] | None = None,
    args: tuple[str, ...] = (),
    rank_prefix: dict[int, list[str]] | None = None,
) -> list[RankResult]:
    """Runs `tests/workers/<worker>.py <scenario> [args]` on `world_size` ranks; returns per-rank
    results. `rank_prefix` puts a command in front of some ranks (e.g. nsenter)."""
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
    port = store.port
    procs = []
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as cwd:  # keep the source tree off sys.path
        for rank in range(world_size):
            rank_environment = dict(os.environ)
            rank_environment.update(
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                RANK=str(rank),
                WORLD_SIZE=str(world_size),
                LOCAL_RANK=str(rank),
                **RANK_ENV,
            )
            rank_environment.update(env or {})
            rank_environment.update((rank_env or {}).get(rank, {}))
            procs.append(
                subprocess.Popen(
                    [*(rank_prefix or {}).get(rank, []), sys.executable, str(WORKERS / f"{worker}.py"), scenario, *args],
                    cwd=cwd,
                    env=rank_environment,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
            )
        results = []
        for rank, proc in enumerate(procs):
            left = max(1.0, timeout - (time.monotonic() - start))
            try:
                out, _ = proc.communicate(timeout=left)
            except subprocess.TimeoutExpired:
                for p in procs:
                    p.kill()
                out, _ = proc.communicate()
                out += f"\n<<rank {rank} killed by the test harness after {timeout} s>>"
            results.append(RankResult(rank, proc.returncode, out, time.monotonic() - start))
    return results


def assert_all_ok(results: list[RankResult]) -> None:
    failed = [r for r in results if r.returncode != 0]
    if failed:
        text = "\n".join(f"--- rank {r.rank} (exit {r.returncode}) ---\n{r.output[-4000:]}" for r in failed)
        pytest.fail(f"{len(failed)} of {len(results)} ranks failed:\n{text}")


def soak_summary(result: RankResult) -> dict | None:
    """The last ``SOAK {json}`` line a tests/workers/soak.py rank printed, or None."""
    lines = [line for line in result.output.splitlines() if line.startswith("SOAK ")]
    return json.loads(lines[-1][len("SOAK "):]) if lines else None
