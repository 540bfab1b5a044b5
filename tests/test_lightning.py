"""ddlcomm's hooks inside PyTorch Lightning (pinned by scripts/setup.sh), 2 CPU ranks under
torchrun: Lightning's automatic optimization calls ``optimizer.step(closure)``, so backward and
the hook run inside ``step()`` (tests/workers/lightning_fit.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

if not os.environ.get("CI"):  # CI has it (scripts/setup.sh): there a missing install fails
    pytest.importorskip("lightning", reason="Lightning is not installed (scripts/setup.sh installs it)")

# With the trainer integrations (tests/test_trainers.py): scripts/test.sh runs them as a step of their own.
pytestmark = pytest.mark.trainers

WORKER = Path(__file__).parent / "workers" / "lightning_fit.py"


def test_lightning_fits_through_the_1bit_compressed_hook_with_step_closure() -> None:
    """The hook registered in ``on_fit_start`` with the optimizer ``configure_optimizers``
    returned (``ddlcomm.optim.SGD``, or torch's SGD converted in place): every step after the 4-step warm-up is compressed, the
    replicas stay bitwise equal, and the accuracy is within 0.5 points of the same fit without
    the hook (docs/choosing-a-compressor.md's margin). Before step() ran the closure first,
    the first compressed step raised ".grad of N parameter(s) changed between backward() and
    step()"."""
    torchrun = Path(sys.executable).parent / "torchrun"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    with tempfile.TemporaryDirectory() as cwd:
        done = subprocess.run([str(torchrun), "--standalone", "--nproc-per-node", "2", str(WORKER)], cwd=cwd,
                              env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))
    result = json.loads(line[len("RESULT "):])
    plain, onebit = result["plain"], result["onebit"]
    assert plain["replicas_equal"] and onebit["replicas_equal"], result
    assert onebit["steps"] == plain["steps"] > 4, result
    assert onebit["compressed_buckets"] == onebit["steps"] - 4, result  # one bucket a step, after the warm-up
    assert onebit["ratio"] > 5, result
    assert onebit["accuracy"] >= plain["accuracy"] - 0.005, result
    # torch's SGD (and its scheduler) as configure_optimizers built it, converted in place by
    # the hook's state: the same training, bit for bit.
    converted = result["onebit_torch_sgd"]
    assert converted["optimizer"] == "ddlcomm.optim", result
    assert converted["checksum"] == onebit["checksum"] and converted["accuracy"] == onebit["accuracy"], result
