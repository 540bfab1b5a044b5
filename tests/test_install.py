"""The package as a user installs it (README, "Install into your environment"): a non-editable
wheel built from the checkout against the installed torch, without build isolation, installed
into a fresh virtual environment; then two ranks under torchrun, started from another
directory, join a "ddlcomm" group without importing ddlcomm (torch's backend autoload) and
all-reduce. The wheel ships the slow-network emulator (``python -m ddlcomm.slownet``) but not
the benchmarks (the checkout's ``bench/``).

The wheel build shares the editable install's build tree (pyproject.toml's build-dir), so it
compiles nothing new. torch and numpy come from the test environment through a .pth line,
after the fresh environment's own site-packages: the point is the wheel, not a second torch."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """
import os, torch, torch.distributed as dist
dist.init_process_group("ddlcomm")
x = torch.full((1000,), float(dist.get_rank() + 1))
dist.all_reduce(x)
import ddlcomm
assert torch.equal(x, torch.full((1000,), 3.0)), x[:4]
with open(f"rank{dist.get_rank()}.txt", "w") as out:  # torchrun interleaves the ranks' stdout
    out.write(os.path.dirname(ddlcomm.__file__))
dist.destroy_process_group()
"""


def _run(cmd: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    result = subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{' '.join(map(str, cmd))} exited {result.returncode}:\n" \
                                   f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


def test_wheel_installs_into_a_fresh_environment_and_runs(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    _run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "-q", ROOT, "-w", wheels],
         ROOT, timeout=900)
    (wheel,) = wheels.glob("ddlcomm-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    benchmarks = [n for n in names if n.startswith(("bench/", "ddlcomm/bench/", "ddlcomm/examples/"))]
    assert not benchmarks, f"the wheel ships benchmarks: {benchmarks}"
    assert {"ddlcomm/slownet/__main__.py", "ddlcomm/slownet/nfq_delay.py"} <= set(names), names
    venv = tmp_path / "venv"
    # Without its own pip (ensurepip takes ~8 s): the test environment's pip installs into it.
    _run([sys.executable, "-m", "venv", "--without-pip", venv], tmp_path, timeout=300)
    python = venv / "bin" / "python"
    site = _run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], tmp_path, 60).stdout.strip()
    Path(site, "torch_from_the_test_environment.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _run([sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps", "--no-index", wheel],
         tmp_path, timeout=300)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "job.py").write_text(SCRIPT)
    _run([python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "job.py"], elsewhere,
         timeout=180)
    imported = [(elsewhere / f"rank{rank}.txt").read_text() for rank in range(2)]
    assert imported == [str(Path(site, "ddlcomm"))] * 2, imported  # the wheel, not the checkout
    # The emulator is a tool of the installed package; the benchmarks are nowhere on its path.
    emulator = _run([python, "-m", "ddlcomm.slownet", "--help"], elsewhere, timeout=120)
    assert "python -m ddlcomm.slownet" in emulator.stdout, emulator.stdout
    found = _run([python, "-c", "import importlib.util; print(importlib.util.find_spec('bench'))"], elsewhere, 60)
    assert found.stdout.strip() == "None", found.stdout
