"""Elastic restarts under torchrun: a rank that exits hard makes torchrun restart the job, and
the new attempt resumes from the checkpoints as if nothing had happened. The rendezvous store
of torchrun's agent outlives the attempts: nothing the first attempt left in it (failure
records, addresses, shared-memory handles) may reach the second."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

WORKER = Path(__file__).parent / "workers" / "elastic.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(tmp: Path, name: str, transport: str, rendezvous: str = "static", kill_at: int = -1,
              path: str = "ddp-onebit") -> tuple[subprocess.CompletedProcess, Path]:
    """The worker on 4 ranks under torchrun --max-restarts 1; (the finished process, the result file)."""
    folder, result = tmp / name, tmp / f"{name}.pt"
    folder.mkdir()
    where = (["--standalone"] if rendezvous == "standalone"
             else ["--master-addr", "127.0.0.1", "--master-port", str(_free_port())])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--max-restarts", "1",
           "--monitor-interval", "0.1", *where, str(WORKER), str(folder), str(result), "20", str(kill_at), path]
    env = {**os.environ, "DDLCOMM_TRANSPORT": transport, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env), result


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> torch.Tensor:
    done, result = _torchrun(tmp_path_factory.mktemp("elastic"), "straight", "shm")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return torch.load(result)


# torchrun's static rendezvous (--master-port), whose agent makes its store once; c10d's
# (--standalone) keeps its store across attempts too, and resumed alike when run by hand
# (docs/failure-modes.md). Shared memory, the local default, whose handles name the processes
# of an attempt; its sums are not TCP's (another order).
@pytest.mark.parametrize("rendezvous", ["static"])
def test_restarted_job_resumes_and_matches_an_uninterrupted_run(tmp_path: Path, uninterrupted: torch.Tensor,
                                                                rendezvous: str) -> None:
    restarted, result = _torchrun(tmp_path, "restarted", "shm", rendezvous, kill_at=12)
    log = restarted.stdout[-3000:] + restarted.stderr[-6000:]
    assert restarted.returncode == 0, log
    assert restarted.stdout.count("attempt 1: from step 10") == 4, log  # it restarted, from the checkpoint
    assert torch.equal(torch.load(result), uninterrupted), "the resumed run trained differently"


# One rank per agent, as on two hosts: the rank on the host that fails dies; the other stays
# healthy (it sleeps), so its agent restarts it for the other host's failure without counting a
# restart of its own (TORCHELASTIC_RESTART_COUNT 0 there, 1 on the failed host).
TWO_HOSTS = """\
import os, sys, time
from datetime import timedelta
import torch, torch.distributed as dist
import ddlcomm  # noqa: F401
marker = sys.argv[1]
first = not os.path.exists(marker)
dist.init_process_group("ddlcomm", timeout=timedelta(seconds=30))
t = torch.ones(3)
dist.all_reduce(t)
if first and dist.get_rank() == 1:
    open(marker, "w").close()
    os._exit(9)
if first:
    time.sleep(120)  # healthy until its agent restarts it
print(f"attempt {os.environ['TORCHELASTIC_RESTART_COUNT']}: {t.tolist()}", flush=True)
dist.destroy_process_group()
"""


def test_agents_that_count_restarts_differently_meet_in_the_next_attempt(tmp_path: Path) -> None:
    script = tmp_path / "two_hosts.py"
    script.write_text(TWO_HOSTS)
    port = _free_port()
    env = {**os.environ, "DDLCOMM_TRANSPORT": "tcp", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    agents = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "two",
                                "--max-restarts", "1", "--monitor-interval", "0.1", str(script), str(tmp_path / "died")],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
              for _ in range(2)]
    outs = [a.communicate(timeout=240)[0] for a in agents]
    log = "\n".join(o[-3000:] for o in outs)
    assert [a.returncode for a in agents] == [0, 0], log
    finished = [line for o in outs for line in o.splitlines() if ": [2.0, 2.0, 2.0]" in line]
    assert sorted(line.split(":")[0][-9:] for line in finished) == ["attempt 0", "attempt 1"], log
