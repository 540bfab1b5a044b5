"""A job that finished its work exits 0: ddlcomm as the default group with a gloo subgroup
beside it (object collectives, DCP and many libraries ask for one), under torchrun. And a job
that fails ends with its own exception's exit, not an abort or a hang."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

# The script of issue 40: gloo's worker threads may release their last Work after the script
# ends; ddlcomm's exit grace lets them (ddlcomm/__init__.py, _destroy_at_exit).
SET_UP = """
import torch, torch.distributed as dist
dist.init_process_group("ddlcomm")
gloo = dist.new_group(backend="gloo")
x = torch.ones(4 << 20)
for _ in range(3): dist.all_reduce(x, group=gloo)
dist.barrier()
"""
FINISHES = SET_UP + """
for _ in range(20): dist.all_reduce(x, group=gloo)
dist.destroy_process_group()
"""
FAILS = SET_UP + """
raise RuntimeError("training failed")
"""


# gloo as the default group. The first handler registered runs last, after ddlcomm's: it counts
# the threads left, a gloo group's among them while anything still holds the group.
ON_GLOO = """
import atexit, os
atexit.register(lambda: os.write(1, f"threads at exit: {len(os.listdir('/proc/self/task'))}\\n".encode()))
import torch, torch.distributed as dist
from ddlcomm import compressors
from ddlcomm.compressed import compressed_all_reduce
dist.init_process_group("gloo")
x = torch.randn(1 << 18)
for _ in range(CALLS):
    compressed_all_reduce(x, compressors.OneBit()).wait()
dist.barrier()
dist.destroy_process_group()
"""


def _torchrun(tmp: Path, source: str) -> subprocess.CompletedProcess:
    script = tmp / "job.py"
    script.write_text(source)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(port), str(script)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, cwd=tmp)


@pytest.mark.parametrize("run", range(2))
def test_finished_job_with_a_gloo_subgroup_exits_0(tmp_path: Path, run: int) -> None:
    done = _torchrun(tmp_path, FINISHES)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]


def test_failed_job_exits_with_its_exception_not_an_abort(tmp_path: Path) -> None:
    done = _torchrun(tmp_path, FAILS)
    assert done.returncode == 1, done.stderr[-4000:]
    assert "RuntimeError: training failed" in done.stderr, done.stderr[-4000:]
    assert "SIGABRT" not in done.stderr and "terminate called" not in done.stderr, done.stderr[-4000:]


def test_a_gloo_group_that_ran_compressed_calls_is_released_before_the_interpreter_ends(tmp_path: Path) -> None:
    """ddlcomm keeps a group's engine, route and levels: all are dropped at exit, so that the group
    a program destroyed is gone (its threads joined) before the interpreter's teardown, where a gloo
    worker thread releasing its last Work can abort the process ("terminate called without an
    active exception"). A run of the job can pass by chance: the threads left are what is checked."""
    threads = {}
    for calls in (0, 5):
        done = _torchrun(tmp_path, ON_GLOO.replace("CALLS", str(calls)))
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
        # Both ranks write to torchrun's one stdout: one write each, read wherever it lands.
        threads[calls] = sorted(re.findall(r"threads at exit: (\d+)", done.stdout))
        assert len(threads[calls]) == 2, done.stdout
    assert threads[5] == threads[0], threads
