"""Tests for bench/slownet.py against real namespaces, veths and qdiscs.

They need root and iproute2 and skip (with the reason) where those are
missing.  All traffic stays inside namespaces the tests create.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "slownet.py"
sys.path.insert(0, str(SCRIPT.parent))

import slownet  # noqa: E402
from slownet import SlowNet, SlowNetUnavailable  # noqa: E402

OK, REASON = SlowNet.available()
needs_net = pytest.mark.skipif(not OK, reason=f"SlowNet unavailable: {REASON}")
needs_netem = pytest.mark.skipif(not SlowNet.probe().netem, reason=f"netem unavailable: {REASON}")

PORT = 5201

# A TCP server: "sink" counts bytes until EOF and answers the count;
# "echo" echoes.  It serves connections until killed.
SERVER = r"""
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[1])))
s.listen(8)
while True:
    c, _ = s.accept()
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    n = 0
    while b := c.recv(1 << 20):
        n += len(b)
        if sys.argv[2] == "echo":
            c.sendall(b)
    if sys.argv[2] == "sink":
        c.sendall(b"%d\n" % n)
    c.close()
"""

# Client helpers; connect() retries until the server is listening.
CLIENT = r"""
import socket, statistics, sys, time
mode, host, port, arg = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])

def connect(deadline):
    while True:
        try:
            s = socket.create_connection((host, port), timeout=max(0.1, deadline - time.time()))
            s.settimeout(10)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return s
        except OSError:
            if time.time() >= deadline:
                raise
            time.sleep(0.05)

if mode == "send":            # arg = bytes; prints bit/s including the final ack
    s = connect(time.time() + 5)
    buf, sent = b"x" * (1 << 20), 0
    t0 = time.perf_counter()
    while sent < arg:
        s.sendall(buf)
        sent += len(buf)
    s.shutdown(socket.SHUT_WR)
    got = int(s.makefile().readline())
    print(sent * 8 / (time.perf_counter() - t0), got, sent)
elif mode == "rtt":           # arg = round trips; prints the median RTT in s
    s = connect(time.time() + 5)
    samples = []
    for _ in range(int(arg) + 1):
        t0 = time.perf_counter()
        s.sendall(b"x")
        assert s.recv(1) == b"x"
        samples.append(time.perf_counter() - t0)
    print(statistics.median(samples[1:]))
elif mode == "probe":         # arg = connect timeout; prints ok or the error
    t0 = time.time()
    try:
        connect(t0 + arg).close()
        print("ok", time.time() - t0)
    except OSError as e:
        print("fail", time.time() - t0, type(e).__name__)
"""


def start_server(net: SlowNet, rank: int, mode: str) -> subprocess.Popen:
    return net.popen(rank, [sys.executable, "-c", SERVER, str(PORT), mode],
                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def client(net: SlowNet, rank: int, mode: str, target: int, arg: float,
           timeout: float = 20) -> list[str]:
    """Run the client in ``rank``'s namespace against ``target``; return its output words."""
    p = net.popen(rank, [sys.executable, "-c", CLIENT, mode, net.address(target), str(PORT), str(arg)],
                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.communicate()
        raise
    assert p.returncode == 0, err
    return out.split()


def ours(net_prefix: str) -> list[str]:
    return [ns for ns in slownet.list_namespaces() if ns.startswith(net_prefix + "-")]


# ---------------------------------------------------------------- network behaviour

@needs_net
def test_topology_and_env() -> None:
    with SlowNet(ranks=3, rate="1gbit") as net:
        assert [net.address(r) for r in range(3)] == ["10.77.0.1", "10.77.0.2", "10.77.0.3"]
        expected = [net.switch_namespace] + [net.namespace(r) for r in range(3)]
        assert sorted(ours(net.prefix)) == sorted(expected)
        env = net.env(2, 12345)
        assert env["MASTER_ADDR"] == "10.77.0.1" and env["MASTER_PORT"] == "12345"
        ranks = (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"])
        assert ranks == ("2", "3", "2", "3")
        assert env["DDLCOMM_SOCKET_IFNAME"] == env["GLOO_SOCKET_IFNAME"] == net.ifname(2)
        assert env["PATH"] == os.environ["PATH"]
        addrs = subprocess.run(["ip", "-n", net.namespace(2), "-4", "-o", "addr", "show"],
                               capture_output=True, text=True, timeout=10, check=True).stdout
        assert "10.77.0.3/24" in addrs and net.ifname(2) in addrs and "127.0.0.1" in addrs
        for r in range(3):  # both ends of every link are shaped
            for ns, dev in ((net.namespace(r), net.ifname(r)), (net.switch_namespace, f"port{r}")):
                q = subprocess.run(["tc", "-n", ns, "qdisc", "show", "dev", dev],
                                   capture_output=True, text=True, timeout=10, check=True).stdout
                assert net.active_shaper in q and "rate 1Gbit" in q, q


@needs_net
def test_throughput_follows_rate() -> None:
    with SlowNet(ranks=2, rate="200mbit") as net:
        start_server(net, 1, "sink")
        for rate_mbit, nbytes in ((200, 8 << 20), (50, 3 << 20)):
            if rate_mbit != 200:
                net.set_rate(f"{rate_mbit}mbit")
            bps, got, sent = client(net, 0, "send", 1, nbytes)
            assert int(got) == int(sent)
            mbit = float(bps) / 1e6
            print(f"configured {rate_mbit} Mbit/s -> measured {mbit:.1f} Mbit/s")
            assert 0.3 * rate_mbit < mbit < 1.2 * rate_mbit


@needs_netem
def test_delay_applies_on_every_link_direction() -> None:
    delay_ms = 5.0
    with SlowNet(ranks=2, rate="1gbit", delay=f"{delay_ms}ms") as net:
        start_server(net, 1, "echo")
        rtt_ms = float(client(net, 0, "rtt", 1, 20)[0]) * 1e3
        print(f"delay {delay_ms} ms per qdisc -> median RTT {rtt_ms:.2f} ms")
        # rank0 veth0 -> switch port1 -> rank1, and back via veth1 -> port0: 4 qdiscs.
        assert 4 * delay_ms * 0.8 <= rtt_ms < 4 * delay_ms * 1.5 + 10


@needs_net
@pytest.mark.skipif(SlowNet.probe().netem, reason="netem is available here")
def test_delay_without_netem_is_refused() -> None:
    with pytest.raises(SlowNetUnavailable, match="netem"):
        with SlowNet(ranks=2, rate="1gbit", delay="1ms"):
            pass
    with SlowNet(ranks=2, rate="1gbit") as net:
        with pytest.raises(SlowNetUnavailable, match="netem"):
            net.set_rate("1gbit", loss="1%")


@needs_net
def test_link_down_and_up() -> None:
    with SlowNet(ranks=2, rate="1gbit") as net:
        start_server(net, 1, "sink")
        assert client(net, 0, "probe", 1, 5)[0] == "ok"
        net.set_link(1, False)
        word, secs, *_ = client(net, 0, "probe", 1, 2)
        assert word == "fail" and float(secs) < 4
        net.set_link(1, True)
        assert client(net, 0, "probe", 1, 10)[0] == "ok"


# ---------------------------------------------------------------- cleanup

@needs_net
def test_cleanup_on_exit_and_on_error() -> None:
    with SlowNet(ranks=2, rate="1gbit") as net:
        prefix = net.prefix
        sleeper = net.popen(1, ["sleep", "60"])
        assert len(ours(prefix)) == 3
    assert ours(prefix) == []
    assert sleeper.poll() is not None  # processes left inside are killed

    with pytest.raises(RuntimeError, match="boom"):
        with SlowNet(ranks=2, rate="1gbit") as net:
            prefix = net.prefix
            raise RuntimeError("boom")
    assert ours(prefix) == []


@needs_net
def test_cleanup_stale_removes_only_dead_owners() -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = f"{slownet.PREFIX}-{dead.pid}-0-sw"
    subprocess.run(["ip", "netns", "add", stale], check=True, timeout=10)
    try:
        with SlowNet(ranks=1, rate="1gbit") as net:
            removed = slownet.cleanup_stale()
            assert stale in removed
            assert len(ours(net.prefix)) == 2  # ours (live PID) untouched
        assert stale not in slownet.list_namespaces()
    finally:
        subprocess.run(["ip", "netns", "del", stale], capture_output=True, timeout=10)


# ---------------------------------------------------------------- CLI

def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """Run the CLI; also check it left none of its namespaces behind."""
    proc = subprocess.Popen([sys.executable, str(SCRIPT), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
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


@needs_net
def test_cli_timeout() -> None:
    p = cli("--ranks", "2", "--rate", "1gbit", "--timeout", "1", "--", "sleep", "60")
    assert p.returncode == 124, p.stderr
    assert "timeout" in p.stderr


@needs_net
@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 128 + signal.SIGTERM), (signal.SIGINT, 130)])
def test_cli_cleans_up_on_signal(sig: int, code: int) -> None:
    proc = subprocess.Popen([sys.executable, str(SCRIPT), "--ranks", "2", "--", "sleep", "60"],
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
    monkeypatch.setattr(slownet.os, "geteuid", lambda: 1000)
    assert slownet.main(["--ranks", "2", "--", "true"]) == 2
    err = capsys.readouterr().err
    assert "root" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1

    monkeypatch.setattr(slownet.os, "geteuid", lambda: 0)
    real_which = slownet.shutil.which
    monkeypatch.setattr(slownet.shutil, "which", lambda t: None if t == "tc" else real_which(t))
    assert slownet.main(["--ranks", "2", "--", "true"]) == 2
    err = capsys.readouterr().err
    assert "`tc` not found" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_cli_as_non_root_exits_2() -> None:
    python = "/usr/bin/python3"
    probe = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                            python, "-c", "open(%r).close()" % str(SCRIPT)],
                           capture_output=True, timeout=10) if os.path.exists(python) else None
    if os.geteuid() != 0 or probe is None or probe.returncode != 0:
        pytest.skip("cannot run the script as an unprivileged user here")
    p = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                        python, str(SCRIPT), "--ranks", "2", "--", "true"],
                       capture_output=True, text=True, timeout=30)
    assert p.returncode == 2
    assert "root" in p.stderr and "Traceback" not in p.stderr


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
