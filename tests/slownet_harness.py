"""What the tests of ddlcomm.bench.slownet share (test_slownet.py, test_slownet_ddlcomm.py,
test_slownet_cli.py): the marks that skip them where SlowNet cannot run, the fixtures that
install iptables where delay and loss need it, and a subprocess helper.

The tests need root and iproute2 and skip (with the reason) where those are missing.
Delay and loss need netem or, without it, iptables, which the first test that needs
it installs if missing (apt-get). A test module that uses the marks imports the fixtures
(``from slownet_harness import impairable, iptables, probe``) so that pytest finds them.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from ddlcomm.bench.slownet import Probe, SlowNet

__all__ = ["OK", "REASON", "needs_net", "needs_impairment", "needs_iptables", "probe", "impairable", "iptables",
           "install_iptables", "communicate_or_kill"]


def install_iptables() -> bool:
    """Without netem, delay/loss need iptables: install it (Debian) where it is missing.
    Returns whether it tried."""
    if os.geteuid() != 0 or shutil.which("iptables") or shutil.which("apt-get") is None:
        return False
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", "iptables"]
    if subprocess.run(install, env=env, capture_output=True, timeout=600).returncode != 0:
        subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, timeout=600)
        subprocess.run(install, env=env, capture_output=True, timeout=600)
    return True


OK, REASON = SlowNet.available()
needs_net = pytest.mark.skipif(not OK, reason=f"SlowNet unavailable: {REASON}")
# Tests marked so install iptables where missing, through the fixtures below (not at collection).
needs_impairment = pytest.mark.usefixtures("impairable")
needs_iptables = pytest.mark.usefixtures("iptables")


@pytest.fixture(scope="session")
def probe() -> Probe:
    """SlowNet.probe(), once iptables is installed where it was missing."""
    if install_iptables():
        SlowNet._probe = None  # the cached probe predates the install
    return SlowNet.probe()


@pytest.fixture(scope="session")
def impairable(probe: Probe) -> None:
    # A probe that is not ok has neither netem nor iptables.
    if not (probe.netem or probe.iptables):
        pytest.skip(f"no delay/loss emulation: {probe.reason}")


@pytest.fixture(scope="session")
def iptables(probe: Probe) -> None:
    if probe.iptables is None:
        pytest.skip(f"no iptables with statistic and NFQUEUE: {probe.reason}")


def communicate_or_kill(p: subprocess.Popen, timeout: float) -> tuple[str, str]:
    """The process's output, or kill it (and re-raise) when it runs past ``timeout``."""
    try:
        return p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.communicate()
        raise
