"""Tests for ddlcomm.slownet's emulated network against real namespaces, veths, qdiscs and
netfilter: addresses and environment, rate, delay, loss, a link taken down, and cleanup.
ddlcomm over it is in test_slownet_ddlcomm.py, the command line in test_slownet_cli.py; what
they need to run (root, iproute2, netem or iptables) is in slownet_harness.py. All traffic
stays inside namespaces the tests create.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from slownet_harness import impairable, iptables, probe  # noqa: F401 (fixtures the marks use)
from slownet_harness import communicate_or_kill, needs_impairment, needs_iptables, needs_net

from ddlcomm import slownet
from ddlcomm.slownet import Probe, SlowNet, SlowNetUnavailable


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
elif mode == "rtt":           # arg = round trips; prints the median RTT and a connect time, in s
    connect(time.time() + 5).close()  # the server is up
    t0 = time.perf_counter()
    s = connect(time.time() + 5)
    connect_s = time.perf_counter() - t0
    samples = []
    for _ in range(int(arg) + 1):
        t0 = time.perf_counter()
        s.sendall(b"x")
        assert s.recv(1) == b"x"
        samples.append(time.perf_counter() - t0)
    print(statistics.median(samples[1:]), connect_s)
elif mode == "udp":           # arg = datagrams; then end markers, which arrive last (FIFO links)
    u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    for i in range(int(arg)):
        u.sendto(b"%08d" % i + b"." * 92, (host, port))
    for _ in range(50):
        u.sendto(b"end", (host, port))
    print(int(arg))
elif mode == "probe":         # arg = connect timeout; prints ok or the error
    t0 = time.time()
    try:
        connect(t0 + arg).close()
        print("ok", time.time() - t0)
    except OSError as e:
        print("fail", time.time() - t0, type(e).__name__)
"""


# Counts UDP datagrams until an end marker; the buffer holds the whole burst, so
# every datagram missing was lost on the way.
UDP_SINK = r"""
import socket, sys
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
u.setsockopt(socket.SOL_SOCKET, 33, 64 << 20)  # SO_RCVBUFFORCE
u.bind(("0.0.0.0", int(sys.argv[1])))
print("ready", flush=True)
n = 0
while u.recv(2048) != b"end":
    n += 1
print(n, flush=True)
"""


def start_server(net: SlowNet, rank: int, mode: str) -> subprocess.Popen:
    return net.popen(rank, [sys.executable, "-c", SERVER, str(PORT), mode],
                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def client(net: SlowNet, rank: int, mode: str, target: int, arg: float,
           timeout: float = 20) -> list[str]:
    """Run the client in ``rank``'s namespace against ``target``; return its output words."""
    p = net.popen(rank, [sys.executable, "-c", CLIENT, mode, net.address(target), str(PORT), str(arg)],
                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = communicate_or_kill(p, timeout)
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


@needs_impairment
def test_delay_applies_on_every_link_direction() -> None:
    delay_ms = 2.5
    with SlowNet(ranks=2, rate="1gbit") as net:
        start_server(net, 1, "echo")
        rtt, connect = (float(x) * 1e3 for x in client(net, 0, "rtt", 1, 50))
        print(f"no delay: median RTT {rtt:.3f} ms, TCP connect {connect:.3f} ms")
        assert rtt < 2 and connect < 2
        net.set_rate("1gbit", delay=f"{delay_ms}ms")
        print(net.describe())
        rtt, connect = (float(x) * 1e3 for x in client(net, 0, "rtt", 1, 50))
        print(f"delay {delay_ms} ms per link direction: median RTT {rtt:.3f} ms, "
              f"TCP connect {connect:.3f} ms")
        # rank0 veth0 -> switch port1 -> rank1, and back via veth1 -> port0: 4 shaped links.
        assert 4 * delay_ms <= rtt < 4 * delay_ms * 1.2 + 1
        assert 4 * delay_ms <= connect < 4 * delay_ms * 1.5 + 5  # SYN, SYN-ACK
        net.set_rate("1gbit")
        assert float(client(net, 0, "rtt", 1, 50)[0]) * 1e3 < 2


@needs_impairment
def test_loss_applies_on_every_link() -> None:
    loss_pct, sent = 1.0, 10_000
    with SlowNet(ranks=2, rate="1gbit", loss=f"{loss_pct}%") as net:
        sink = net.popen(1, [sys.executable, "-c", UDP_SINK, str(PORT)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert sink.stdout is not None and sink.stdout.readline().strip() == "ready"
        assert int(client(net, 0, "udp", 1, sent)[0]) == sent
        received = int(communicate_or_kill(sink, 20)[0])
    expected = 1 - (1 - loss_pct / 100) ** 2  # a path crosses two lossy links
    lost = (sent - received) / sent
    print(f"loss {loss_pct}% per link direction: {sent - received} of {sent} UDP datagrams "
          f"lost ({lost:.2%}, expected {expected:.2%})")
    assert 0.7 * expected < lost < 1.3 * expected  # +-4 standard deviations


@needs_iptables
def test_delay_with_tbf_uses_the_fixture() -> None:
    with SlowNet(ranks=2, rate="1gbit", delay="1ms", loss="0.5%", shaper="tbf") as net:
        assert "NFQUEUE to nfq_delay.py" in net.describe()
        ns = net.namespace(1)
        rules = slownet.sh("ip", "netns", "exec", ns, str(SlowNet.probe().iptables), "-S")
        assert f"-A INPUT -i {net.ifname(1)} -j {slownet.CHAIN}" in rules
        probabilities = re.findall(r"--mode random --probability (\S+) -j DROP", rules)
        assert [float(p) for p in probabilities] == pytest.approx([0.005, 0.005]), rules
        assert "NFQUEUE --queue-num 0" in rules and "bypass" not in rules
        delayers = [int(p) for p in slownet.sh("ip", "netns", "pids", ns).split()]
        assert len(delayers) == 1
    for pid in delayers:  # killed and reaped
        assert not os.path.exists(f"/proc/{pid}")


@needs_net
def test_delay_without_netem_or_iptables_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(SlowNet, "_probe", Probe(True, "test", netem=False, tbf=True))
    with pytest.raises(SlowNetUnavailable, match="netem or iptables"):
        with SlowNet(ranks=2, rate="1gbit", delay="1ms"):
            pass


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
