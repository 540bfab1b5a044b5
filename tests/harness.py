"""Multi-process test harness: starts N ranks directly (env:// rendezvous on loopback),
each running a scenario from tests/workers/, and reports every rank's exit code and output.

Ranks are started directly rather than through torchrun so that a test sees what each
surviving rank does after another fails (torchrun's agent would kill them all). As under
torchrun, the TCPStore lives outside the ranks (here, in the test process), so it
outlives any rank that dies.

Ranks are forked from a zygote (tests/zygote.py) that has imported torch and ddlcomm once,
unless a rank's environment changes something read at import time (anything but the
rendezvous, ``DDLCOMM_*`` and ``UCX_*`` variables) or runs under a prefix command; then, or
with ``DDLCOMM_TEST_ZYGOTE=0``, it is a fresh ``python`` process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

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


# Variables that a forked rank may set differently from the zygote: none is read at import
# (pytest names the current test in PYTEST_CURRENT_TEST: without it here, only the first
# test's ranks were forked; torch sets TORCHINDUCTOR_CACHE_DIR in this process the first
# time a test here builds an optimizer: without it, every rank after that one started a
# fresh interpreter, and the suite ran 1.6x longer).
FORKABLE_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "DDLCOMM_", "UCX_",
                "PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR")


class _Forked:
    """A rank forked by the zygote, with the part of subprocess.Popen that launch() uses."""

    def __init__(self, zygote: "_Zygote", request_id: int, pid: int, out_path: str) -> None:
        self._zygote, self._id, self.pid, self._out = zygote, request_id, pid, out_path
        self.returncode: int | None = None

    def kill(self) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, 9)
            except ProcessLookupError:
                pass

    def communicate(self, timeout: float | None = None) -> tuple[str, None]:
        code = self._zygote.wait(self._id, timeout)
        if code is None:
            raise subprocess.TimeoutExpired(f"rank pid {self.pid}", timeout)
        self.returncode = code
        with open(self._out, errors="replace") as f:
            return f.read(), None


class _Zygote:
    """The zygote process and the reader of its replies (one per pytest session)."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self._proc = subprocess.Popen([sys.executable, str(Path(__file__).parent / "zygote.py")], env=env,
                                      cwd=tempfile.gettempdir(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      text=True)
        hello = json.loads(self._proc.stdout.readline() or "{}")
        if not hello.get("ready"):
            self._proc.kill()
            raise RuntimeError(f"the test zygote did not start: {hello}")
        self._cond = threading.Condition()
        self._pids: dict[int, int] = {}
        self._codes: dict[int, int] = {}
        self._next = 0
        self.alive = True
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self._proc.stdout:
            message = json.loads(line)
            with self._cond:
                if "pid" in message:
                    self._pids[message["id"]] = message["pid"]
                else:
                    self._codes[message["id"]] = message["returncode"]
                self._cond.notify_all()
        with self._cond:  # the zygote died: its ranks' statuses are lost
            self.alive = False
            self._cond.notify_all()

    def spawn(self, argv: list[str], env: dict[str, str], cwd: str, out_path: str) -> _Forked:
        with self._cond:
            request_id = self._next
            self._next += 1
            self._proc.stdin.write(json.dumps({"id": request_id, "argv": argv, "env": env, "cwd": cwd,
                                               "out": out_path}) + "\n")
            self._proc.stdin.flush()
            if not self._cond.wait_for(lambda: request_id in self._pids or not self.alive, timeout=30):
                raise RuntimeError("the test zygote did not fork a rank within 30 s")
            if not self.alive:
                raise RuntimeError("the test zygote died")
            return _Forked(self, request_id, self._pids.pop(request_id), out_path)

    def wait(self, request_id: int, timeout: float | None) -> int | None:
        with self._cond:
            self._cond.wait_for(lambda: request_id in self._codes or not self.alive, timeout=timeout)
            if request_id in self._codes:
                return self._codes.pop(request_id)
            if not self.alive:
                return -1000  # unknown: the zygote that reaps it is gone
            return None


_zygote: _Zygote | None = None


def _zygote_for(rank_environment: dict[str, str]) -> _Zygote | None:
    """The session's zygote if this rank may be forked from it, else None."""
    global _zygote
    if os.environ.get("DDLCOMM_TEST_ZYGOTE", "1") == "0":
        return None
    if _zygote is None or not _zygote.alive:
        _zygote = _Zygote(dict(os.environ, **RANK_ENV))
    # Against the environment the zygote imported torch under, not today's os.environ.
    base = _zygote.env
    changed = {k for k in rank_environment.keys() | base.keys() if rank_environment.get(k) != base.get(k)}
    if any(not k.startswith(FORKABLE_ENV) for k in changed):
        return None
    return _zygote


@dataclass
class RankResult:
    rank: int
    returncode: int
    output: str
    seconds: float


def named_hosts(hosts: int = 2, per_host: int = 2) -> dict[int, dict[str, str]]:
    """A ``rank_env`` that places ``hosts * per_host`` ranks on named hosts (``DDLCOMM_HOST_ID``):
    rank r on host r // per_host."""
    return {r: {"DDLCOMM_HOST_ID": f"host-{r // per_host}"} for r in range(hosts * per_host)}


def launch(scenario: Callable[..., Any], world_size: int, args: tuple[str, ...] = (), **options: Any
           ) -> list[RankResult]:
    """Runs `scenario`, a function of a tests/workers module (the per-rank body), on `world_size`
    ranks with `args` (strings); returns per-rank results (``options``: those of
    ``launch_script``)."""
    module = scenario.__module__.rsplit(".", 1)[-1]
    results = launch_script(WORKERS / f"{module}.py", world_size, args=(scenario.__name__, *args), **options)
    # A rank that exits 0 without common.run's line never ran the scenario (a module without
    # its `run()` under __main__): a failure, not a pass.
    done = f"scenario {scenario.__name__} OK"
    return [RankResult(r.rank, 1, r.output + f"\n(exit 0 without '{done}')", r.seconds)
            if r.returncode == 0 and done not in r.output else r for r in results]


def launch_script(
    script: Path,
    world_size: int,
    timeout: float = 120.0,
    env: dict[str, str] | None = None,
    rank_env: dict[int, dict[str, str]] | None = None,
    args: tuple[str, ...] = (),
    rank_prefix: dict[int, list[str]] | None = None,
) -> list[RankResult]:
    """Runs `script [args]` on `world_size` ranks, with the environment torchrun gives them
    (MASTER_ADDR/PORT, RANK, WORLD_SIZE, LOCAL_RANK); forked from the zygote where it can be.
    `rank_prefix` puts a command in front of some ranks (e.g. nsenter)."""
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
            argv = [str(script), *args]
            zygote = None if (rank_prefix or {}).get(rank) else _zygote_for(rank_environment)
            if zygote is not None:
                procs.append(zygote.spawn(argv, rank_environment, cwd, os.path.join(cwd, f"rank{rank}.out")))
                continue
            procs.append(
                subprocess.Popen(
                    [*(rank_prefix or {}).get(rank, []), sys.executable, *argv],
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
