"""What the tests of ddlcomm.slownet share (test_slownet.py, test_slownet_ddlcomm.py,
test_slownet_cli.py): the marks that skip them where SlowNet cannot run, the fixtures behind
them, and a subprocess helper.

The tests need root and iproute2 and skip (with the reason) where those are missing.
Delay and loss need netem or, without it, iptables (scripts/setup.sh installs iproute2 and
iptables; a test never installs a package, which would hide a set-up step that is missing).
A test module that uses the marks imports the fixtures
(``from slownet_harness import impairable, iptables, probe``) so that pytest finds them.
"""

from __future__ import annotations

import subprocess

import pytest

from ddlcomm.slownet import Probe, SlowNet

__all__ = ["OK", "REASON", "needs_net", "needs_impairment", "needs_iptables", "probe", "impairable", "iptables",
           "communicate_or_kill"]


OK, REASON = SlowNet.available()
needs_net = pytest.mark.skipif(not OK, reason=f"SlowNet unavailable: {REASON}")
# Fixtures rather than skipif marks: the probe runs when a test needs it, not at collection.
needs_impairment = pytest.mark.usefixtures("impairable")
needs_iptables = pytest.mark.usefixtures("iptables")


@pytest.fixture(scope="session")
def probe() -> Probe:
    """SlowNet.probe() (cached)."""
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
