"""Running a command once per rank of an emulated network: every rank's output streamed with a
``[rank N]`` prefix, the others killed after one fails, a timeout, a stop flag, and one exit
code for the run. The standard library only."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from typing import IO, TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from .network import SlowNet

# Rank 0's namespace is brand new and private, so any port is free there.
DEFAULT_MASTER_PORT = 29500


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL ``proc`` and, if it leads its own process group, the whole group."""
    try:
        if os.getpgid(proc.pid) == proc.pid:
            os.killpg(proc.pid, signal.SIGKILL)
        else:
            proc.kill()
    except (ProcessLookupError, PermissionError):
        pass


def _pump(stream: IO[bytes], prefix: str, lock: threading.Lock, out: IO[str]) -> None:
    """Copy lines from ``stream`` to ``out``, each prefixed."""
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace").rstrip("\r\n")
        with lock:
            out.write(f"{prefix}{line}\n")
            out.flush()
    stream.close()


def _exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def run_ranks(net: SlowNet, argv: Sequence[str], master_port: int = DEFAULT_MASTER_PORT,
              timeout: float = 600.0, grace: float = 10.0, out: IO[str] | None = None,
              stop: threading.Event | None = None) -> int:
    """Run ``argv`` once per rank and stream prefixed output.

    Returns 0 if every rank exits 0, else the first non-zero exit code.  After
    a failure the other ranks get ``grace`` seconds, then are killed; after
    ``timeout`` seconds everything is killed (exit 124 unless a rank failed).
    When ``stop`` is set, every rank is killed at once (exit 130 unless a rank
    failed; the caller knows which signal set it).
    """
    out = out or sys.stdout
    lock = threading.Lock()
    procs, pumps = [], []
    for r in range(net.ranks):
        env = net.env(r, master_port)
        env.setdefault("PYTHONUNBUFFERED", "1")
        p = net.popen(r, argv, env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                      stderr=subprocess.STDOUT, start_new_session=True)
        t = threading.Thread(target=_pump, args=(p.stdout, f"[rank {r}] ", lock, out), daemon=True)
        t.start()
        procs.append(p)
        pumps.append(t)

    def log(msg: str) -> None:
        with lock:
            print(f"[slownet] {msg}", file=sys.stderr, flush=True)

    deadline, kill_at, result = time.monotonic() + timeout, None, 0
    while True:
        codes = [p.poll() for p in procs]
        for r, code in enumerate(codes):
            if code and not result:
                result, kill_at = _exit_code(code), time.monotonic() + grace
                log(f"rank {r} exited with {result}; killing the others in {grace:g}s")
        if all(code is not None for code in codes):
            break
        now = time.monotonic()
        stopped = stop is not None and stop.is_set()
        if stopped or now >= deadline or (kill_at is not None and now >= kill_at):
            if stopped:
                result = result or 130
            elif now >= deadline:
                log(f"timeout after {timeout:g}s; killing all ranks")
                result = result or 124
            for p in procs:
                if p.poll() is None:
                    kill_tree(p)
            break
        time.sleep(0.05)
    for p in procs:
        p.wait()
    for t in pumps:
        t.join(timeout=2)
    return result
