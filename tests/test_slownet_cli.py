"""The command line of ddlcomm.slownet (``python -m ddlcomm.slownet``): it runs every
rank, propagates failures, times out, cleans up on signals and refuses what it cannot do; and
the units its options take. What the tests need to run is in slownet_harness.py.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slownet_harness import impairable, iptables, probe  # noqa: F401 (fixtures the marks use)
from slownet_harness import communicate_or_kill, needs_iptables, needs_net

from ddlcomm import slownet
from ddlcomm.slownet import SlowNet

CLI = [sys.executable, "-m", "ddlcomm.slownet"]


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """Run the CLI; also check it left none of its namespaces behind."""
    proc = subprocess.Popen([*CLI, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    out, err = communicate_or_kill(proc, timeout)
    assert not [ns for ns in slownet.list_namespaces() if ns.startswith(f"ddl-{proc.pid}-")]
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@needs_net
def test_cli_runs_every_rank() -> None:
    p = cli("--ranks", "2", "--rate", "1gbit", "--", sys.executable, "-c",
            "import os; print(os.environ['RANK'], os.environ['MASTER_ADDR'])")
    assert p.returncode == 0, p.stderr
    assert sorted(p.stdout.splitlines()) == ["[rank 0] 0 10.77.0.1", "[rank 1] 1 10.77.0.1"]


@needs_net
def test_cli_propagates_failure_and_kills_after_grace() -> None:
    code = "import os, sys, time; r = os.environ['RANK']; sys.exit(3) if r == '1' else time.sleep(60)"
    t0 = time.monotonic()
    p = cli("--ranks", "2", "--rate", "1gbit", "--grace", "1", "--", sys.executable, "-c", code)
    assert p.returncode == 3, p.stderr
    assert time.monotonic() - t0 < 20
    assert "rank 1 exited with 3" in p.stderr


@needs_iptables
def test_cli_says_how_delay_and_loss_are_emulated() -> None:
    p = cli("--ranks", "2", "--shaper", "tbf", "--delay", "1ms", "--loss", "1%", "--",
            str(SlowNet.probe().iptables), "-S")
    assert p.returncode == 0, p.stderr
    assert "delay 1ms loss 1% per link direction emulated at each receiver" in p.stderr
    assert "NFQUEUE to nfq_delay.py" in p.stderr
    assert p.stdout.count("-j NFQUEUE") == 2


@needs_net
def test_cli_timeout() -> None:
    p = cli("--ranks", "2", "--rate", "1gbit", "--timeout", "1", "--", "sleep", "60")
    assert p.returncode == 124, p.stderr
    assert "timeout" in p.stderr


@needs_net
@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 128 + signal.SIGTERM), (signal.SIGINT, 130)])
def test_cli_cleans_up_on_signal(sig: int, code: int) -> None:
    proc = subprocess.Popen([*CLI, "--ranks", "2", "--", "sleep", "60"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    prefix = f"ddl-{proc.pid}-"
    try:
        deadline = time.monotonic() + 15
        while len([ns for ns in slownet.list_namespaces() if ns.startswith(prefix)]) < 3:
            assert time.monotonic() < deadline and proc.poll() is None, "CLI did not set up"
            time.sleep(0.05)
        time.sleep(0.3)  # let the ranks start
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == code, err
    assert "Traceback" not in err
    assert not [ns for ns in slownet.list_namespaces() if ns.startswith(prefix)]


def test_cli_preconditions_exit_2(monkeypatch: pytest.MonkeyPatch,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(slownet.probe.os, "geteuid", lambda: 1000)
    assert slownet.main(["--ranks", "2", "--", "true"]) == 2
    err = capsys.readouterr().err
    assert "root" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1

    monkeypatch.setattr(slownet.probe.os, "geteuid", lambda: 0)
    real_which = slownet.probe.shutil.which
    monkeypatch.setattr(slownet.probe.shutil, "which", lambda t: None if t == "tc" else real_which(t))
    assert slownet.main(["--ranks", "2", "--", "true"]) == 2
    err = capsys.readouterr().err
    assert "`tc` not found" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_cli_as_non_root_exits_2() -> None:
    nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("cannot run the command line as an unprivileged user here")
    check = subprocess.run([*nobody, *CLI, "--check"], capture_output=True, text=True, timeout=60)
    # The unprivileged user must be able to import the package (torch and ddlcomm included).
    if check.returncode not in (0, 1) or "slownet:" not in check.stdout:
        pytest.skip(f"cannot run the command line as an unprivileged user here: {check.stderr[-500:]}")
    assert check.returncode == 1 and "cannot emulate the network: must run as root" in check.stdout, check
    p = subprocess.run([*nobody, *CLI, "--ranks", "2", "--", "true"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2
    assert "root" in p.stderr and "Traceback" not in p.stderr


def _without_iptables(tmp_path: Path) -> dict[str, str]:
    """An environment whose PATH holds every command of this one's but iptables (links in a
    directory of their own): how a machine without the iptables package looks to slownet."""
    hidden = tmp_path / "bin"
    hidden.mkdir()
    for directory in os.environ.get("PATH", "").split(os.pathsep):
        if not os.path.isdir(directory):
            continue
        for name in os.listdir(directory):
            target = os.path.join(directory, name)
            if not name.startswith(("iptables", "ip6tables")) and not (hidden / name).exists() \
                    and os.access(target, os.X_OK) and os.path.isfile(target):
                (hidden / name).symlink_to(target)
    return dict(os.environ, PATH=str(hidden))


@pytest.mark.parametrize("tools", ["all", "no iptables"])
@pytest.mark.parametrize("impairment", [[], ["--delay", "1ms"], ["--loss", "1%"]])
def test_check_answers_what_a_run_does(tools: str, impairment: list[str], tmp_path: Path) -> None:
    """scripts/demo.sh runs its slow-network part only where ``--check`` exits 0: for the rate,
    delay and loss asked, the check says yes exactly when a run with them starts, with the
    delay tools present and hidden (a kernel without netem needs iptables for delay and loss)."""
    env = None if tools == "all" else _without_iptables(tmp_path)
    options = ["--rate", "1gbit", *impairment]
    check = subprocess.run([*CLI, "--check", *options], capture_output=True, text=True, timeout=60, env=env)
    assert check.returncode in (0, 1) and len(check.stdout.strip().splitlines()) == 1, check
    run = subprocess.run([*CLI, "--ranks", "2", *options, "--", "true"], capture_output=True, text=True,
                         timeout=120, env=env)
    if check.returncode == 0:
        assert check.stdout.startswith("slownet: can emulate the network (rate 1000mbit"), check.stdout
        assert run.returncode == 0, run.stderr
    else:
        assert check.stdout.startswith("slownet: cannot emulate the network: "), check.stdout
        reason = check.stdout.strip().removeprefix("slownet: cannot emulate the network: ")
        assert run.returncode == 2 and reason in run.stderr, (reason, run.stderr)
    probe = SlowNet.probe()
    if probe.ok and (probe.netem or probe.iptables):  # so the hidden case is the one without the tools
        expect = 0 if tools == "all" or probe.netem or not impairment else 1
        assert check.returncode == expect, check.stdout


def test_units() -> None:
    assert slownet.parse_rate("1gbit") == 1e9
    assert slownet.parse_rate("200mbit") == 200e6
    assert slownet.parse_rate("1mbps") == 8e6
    assert slownet.parse_rate("1kibit") == 1024
    assert slownet.parse_time("0.1ms") == pytest.approx(1e-4)
    assert slownet.parse_time("100us") == pytest.approx(1e-4)
    assert slownet.parse_time("0") == 0
    assert slownet.parse_loss("0.5%") == 0.5 and slownet.parse_loss(None) == 0
    bad_inputs = (("fast", slownet.parse_rate), ("5", slownet.parse_time),
                  ("200%", slownet.parse_loss))
    for bad, fn in bad_inputs:
        with pytest.raises(ValueError):
            fn(bad)
