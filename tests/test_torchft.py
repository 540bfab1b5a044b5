"""ddlcomm inside torchft (docs/torchft.md): torchft's lighthouse, three replicas (one rank
each) whose Managers reconfigure a ddlcomm.torchft.ProcessGroupDdlcomm at every quorum, and
torchft's DiLoCo training a tiny model. One replica is SIGKILLed mid-training and started again.

Each replica is tests/workers/torchft_replica.py, run as its own process: it logs every
committed outer step (its number, the quorum's size, a hash of the parameters) to a file named
after its pid.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

try:
    from torchft._torchft import LighthouseServer
except ImportError as e:
    pytest.skip(f"torchft is not installed ({e}); scripts/setup.sh installs it "
                "(pip install --no-deps torchft and its opentelemetry packages)", allow_module_level=True)

WORKER = Path(__file__).parent / "workers" / "torchft_replica.py"
REPLICAS = 3
VICTIM = 2


def _records(out: Path, replica: int) -> dict[int, list[dict]]:
    """Each process of `replica`: pid -> its committed steps, in order."""
    found = {}
    for path in out.glob(f"replica{replica}.*.jsonl"):
        lines = path.read_text().split("\n")[:-1]  # whole lines only: the replica may be writing one
        found[int(path.name.split(".")[1])] = [json.loads(line) for line in lines if line]
    return found


def _start(lighthouse: str, replica: int, out: Path, extra: list[str]) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", DDLCOMM_SOCKET_ADDR="127.0.0.1",
               RUST_LOG="warn")
    log = (out / f"replica{replica}.{time.monotonic_ns()}.log").open("w")
    return subprocess.Popen([sys.executable, str(WORKER), lighthouse, str(replica), str(out), *extra],
                            env=env, stdout=log, stderr=subprocess.STDOUT)


def _logs(out: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(out.glob("*.log")))


def _wait_for(predicate, timeout: float, what: str, procs: list[subprocess.Popen], out: Path) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in procs):
            pytest.fail(f"timed out waiting for {what}; exit codes {[p.poll() for p in procs]}\n{_logs(out)}")
        time.sleep(0.1)


def _finish(procs: list[subprocess.Popen], out: Path, who: str) -> str:
    """Waits (60 s in all) for every replica to exit, asserts each exited 0; returns their logs."""
    deadline = time.monotonic() + 60
    for p in procs:
        try:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _wait_for(lambda: False, 0, f"{who} to finish", procs, out)
    codes = [p.returncode for p in procs]
    logs = _logs(out)
    assert codes == [0] * len(procs), f"exit codes {codes}\n{logs}"
    return logs


def _stop(procs: list[subprocess.Popen], lighthouse: Any) -> None:
    """Kills what is still running (after a failure) and the lighthouse."""
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    lighthouse.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("compress", [False, True], ids=["exact", "ternary"])
def test_replica_killed_and_restarted_rejoins_with_equal_weights(tmp_path: Path, compress: bool) -> None:
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=2000, quorum_tick_ms=50,
                                  heartbeat_timeout_ms=1000)
    address = "http://127.0.0.1:" + lighthouse.address().rsplit(":", 1)[1]
    extra = ["--replicas", str(REPLICAS)] + (["--compress"] if compress else [])
    procs = [_start(address, i, tmp_path, extra) for i in range(REPLICAS) if i != VICTIM]
    try:
        # The victim commits two outer steps in a quorum of all three, then SIGKILLs itself in
        # the next sync: after the quorum (its ddlcomm group is up), before the all-reduce, in
        # which the survivors then wait for it.
        victim = _start(address, VICTIM, tmp_path, extra + ["--die-after-full-syncs", "2"])
        procs.append(victim)
        killed_pid = victim.pid
        survivors = {i: procs[i].pid for i in range(REPLICAS) if i != VICTIM}
        _wait_for(lambda: victim.poll() is not None, 60, "the victim to kill itself", procs[:2], tmp_path)
        assert victim.returncode == -signal.SIGKILL, _logs(tmp_path)
        procs.pop()
        procs.append(_start(address, VICTIM, tmp_path, extra))
        restarted = procs[VICTIM].pid
        _wait_for(lambda: any(r["participants"] == REPLICAS for r in _records(tmp_path, VICTIM).get(restarted, [])),
                  60, "the restarted replica's first sync with all three", procs, tmp_path)
        # Every replica stops after the same commit, some outer steps on (written atomically; the
        # margin lets every replica read it before it gets there).
        last = max(r["step"] for i in range(REPLICAS) for rs in _records(tmp_path, i).values() for r in rs)
        (tmp_path / "stop.tmp").write_text(str(last + 10))
        (tmp_path / "stop.tmp").rename(tmp_path / "stop")
        logs = _finish(procs, tmp_path, "every replica")
    finally:
        _stop(procs, lighthouse)

    # The survivors never restarted: one process (one pid) each, the one started first.
    for i, pid in survivors.items():
        assert list(_records(tmp_path, i)) == [pid], f"replica {i} ran as {list(_records(tmp_path, i))}"
    victim_runs = _records(tmp_path, VICTIM)
    assert set(victim_runs) == {killed_pid, procs[VICTIM].pid}
    rejoined = victim_runs[procs[VICTIM].pid]
    # The rejoined replica healed from a peer, then synced in quorums of all three: from its first
    # committed step on, every replica that committed that step holds the same bits.
    full = [r for r in rejoined if r["participants"] == REPLICAS]
    assert full, f"the restarted replica never synced with all three: {rejoined}\n{logs}"
    by_step = {i: {r["step"]: r["sha"] for r in rs} for i in survivors for rs in _records(tmp_path, i).values()}
    for record in full:
        for i in survivors:
            assert by_step[i].get(record["step"]) == record["sha"], \
                f"step {record['step']}: replica {i} differs from the rejoined replica\n{logs}"
    # Each survivor's all-reduce raised ddlcomm's DistBackendError naming the lost peer, which
    # torchft's Manager reported (dropping the step) instead of dying.
    for i in survivors:
        text = "".join(p.read_text() for p in tmp_path.glob(f"replica{i}.*.log"))
        assert "DistBackendError" in text and "lost rank" in text, \
            f"replica {i} logged no error of the lost peer\n{logs}"
    # With --compress every sync went through ddlcomm's ternary all-reduce (4 tensors per sync).
    final = [rs[-1] for i in range(REPLICAS) for rs in _records(tmp_path, i).values() if rs]
    assert all((r["compressed"] > 0) == compress for r in final), final
    # The survivors saw the loss (their steps continued past the kill, in quorums of two).
    assert any(r["participants"] == REPLICAS - 1 for i in survivors for rs in _records(tmp_path, i).values()
               for r in rs), "no step ran in a quorum of two while the victim was away"


def test_group_failure_without_a_lost_replica_gets_a_new_group(tmp_path: Path) -> None:
    """A ddlcomm group that fails with every replica alive (here: one replica aborts its group
    inside a sync) changes no membership; torchft's lighthouse still starts a new quorum after
    the failed commit, so the next sync runs on a fresh ddlcomm group."""
    out = tmp_path
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=2000, quorum_tick_ms=50,
                                  heartbeat_timeout_ms=1000)
    address = "http://127.0.0.1:" + lighthouse.address().rsplit(":", 1)[1]
    (out / "stop").write_text("8")  # both stop after committing outer step 8
    procs = [_start(address, i, out, ["--replicas", "2"] + (["--abort-group-at-step", "3"] if i else []))
             for i in range(2)]
    try:
        logs = _finish(procs, out, "both replicas")
    finally:
        _stop(procs, lighthouse)
    runs = [_records(out, i) for i in range(2)]
    assert all(len(r) == 1 for r in runs), runs  # one process each
    first, second = (next(iter(r.values())) for r in runs)
    # The aborted sync was dropped (its error reported), the next ones committed: equal bits.
    assert [(r["step"], r["sha"]) for r in first] == [(r["step"], r["sha"]) for r in second], logs
    assert first[-1]["step"] >= 8, first
    assert "shut its transport down" in logs and "DistBackendError" in logs, logs
