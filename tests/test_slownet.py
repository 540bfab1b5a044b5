"""Tests for ddlcomm.bench.slownet against real namespaces, veths, qdiscs and netfilter, and
of ddlcomm over it: ranks in separate namespaces, a lossy slow network, a link cut.

They need root and iproute2 and skip (with the reason) where those are missing.
Delay and loss need netem or, without it, iptables, which the first test that needs
it installs if missing (apt-get).  All traffic stays inside namespaces the tests create.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import pytest

from harness import RANK_ENV, WORKERS

from ddlcomm.bench import slownet
from ddlcomm.bench.slownet import Probe, SlowNet, SlowNetUnavailable

CLI = [sys.executable, "-m", "ddlcomm.bench.slownet"]


def _install_iptables() -> bool:
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
    if _install_iptables():
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


def communicate_or_kill(p: subprocess.Popen, timeout: float) -> tuple[str, str]:
    """The process's output, or kill it (and re-raise) when it runs past ``timeout``."""
    try:
        return p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.communicate()
        raise


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


# ---------------------------------------------------------------- ddlcomm over the network

# The rendezvous store, hosted as torchrun's agent would be: in rank 0's namespace
# (MASTER_ADDR) but outside the ranks, so it outlives any of them.
STORE = r"""
import sys
from torch.distributed import TCPStore
store = TCPStore(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), is_master=True,
                 wait_for_workers=False)
print("ready", flush=True)
sys.stdin.read()  # serve until SlowNet kills it on close (or the test dies: EOF)
"""


class Ranks:
    """tests/workers/impaired.py on every rank of ``net``, each in its own namespace;
    their output collected line by line as it comes."""

    def __init__(self, net: SlowNet, cwd: Path, scenario: str, *args: str) -> None:
        port = slownet.DEFAULT_MASTER_PORT
        store = net.popen(0, [sys.executable, "-c", STORE, net.address(0), str(port), str(net.ranks)],
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert store.stdout is not None and store.stdout.readline().strip() == "ready"
        self.output: list[list[str]] = [[] for _ in range(net.ranks)]
        self.exited_at: list[float | None] = [None] * net.ranks  # when its output closed
        self.changed = threading.Condition()
        self.procs = []
        for r in range(net.ranks):
            env = net.env(r, port)
            env.update(RANK_ENV)
            proc = net.popen(r, [sys.executable, str(WORKERS / "impaired.py"), scenario, *args],
                             env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
            threading.Thread(target=self._read, args=(r, proc.stdout), daemon=True).start()
            self.procs.append(proc)

    def _read(self, rank: int, stream: Any) -> None:
        for line in stream:
            with self.changed:
                self.output[rank].append(line.rstrip("\n"))
                self.changed.notify_all()
        with self.changed:
            self.exited_at[rank] = time.monotonic()
            self.changed.notify_all()

    def fail(self, why: str) -> None:
        text = "\n".join(f"--- rank {r} ---\n" + "\n".join(lines[-60:])
                         for r, lines in enumerate(self.output))
        pytest.fail(f"{why}\n{text}")

    def first(self, prefix: str) -> dict[int, str]:
        """Each rank's first line starting with ``prefix``, for the ranks that printed one."""
        with self.changed:
            return {r: next(x for x in out if x.startswith(prefix))
                    for r, out in enumerate(self.output) if any(x.startswith(prefix) for x in out)}

    def wait_for(self, prefix: str, timeout: float) -> None:
        """Wait until every rank printed a line starting with ``prefix``; fail if one exits
        without or ``timeout`` s pass."""
        n = len(self.procs)

        def done() -> bool:
            printed = self.first(prefix)
            return len(printed) == n or any(self.exited_at[r] and r not in printed for r in range(n))

        with self.changed:
            self.changed.wait_for(done, timeout)
        missing = sorted(set(range(n)) - set(self.first(prefix)))
        if missing:
            self.fail(f"ranks {missing} did not print {prefix!r} within {timeout:g} s")

    def wait_exit(self, ranks: Sequence[int], timeout: float) -> list[int]:
        """Wait up to ``timeout`` s for ``ranks`` to exit; return those still running."""
        deadline = time.monotonic() + timeout
        with self.changed:
            self.changed.wait_for(lambda: all(self.exited_at[r] for r in ranks), timeout)
        running = []
        for r in ranks:
            try:
                self.procs[r].wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                running.append(r)
        return running

    def finish(self, timeout: float) -> None:
        """Every rank exits 0 within ``timeout`` s, else fail (SlowNet kills what is left)."""
        running = self.wait_exit(range(len(self.procs)), timeout)
        if running:
            self.fail(f"ranks {running} still running after {timeout:g} s")
        codes = [p.returncode for p in self.procs]
        if any(codes):
            self.fail(f"exit codes {codes}")


# Per link direction; a path between two ranks crosses two links: 5 ms one way
# (RTT 10 ms) and 1 - 0.995**2 = 1.0% loss, as `netem delay 5ms loss 1%` on each host.
LINK_DELAY, LINK_LOSS = "2.5ms", "0.5%"


@needs_impairment
def test_ddlcomm_exact_over_lossy_slow_network(tmp_path: Path) -> None:
    with SlowNet(ranks=4, rate="1gbit", delay=LINK_DELAY, loss=LINK_LOSS) as net:
        print(net.describe())
        t0 = time.monotonic()
        ranks = Ranks(net, tmp_path, "mixed")
        ranks.finish(timeout=120)
        dropped = net.dropped_packets()
    for line in ranks.first("rank ").values():
        print(line)
    print(f"4 ranks done in {time.monotonic() - t0:.1f} s, {dropped} packets dropped on the way")
    assert dropped > 0, "the emulated loss dropped nothing"


@dataclass
class Cut:
    """What each rank did after rank ``rank``'s link went down."""

    rank: int
    timeout: float
    failed_after: dict[int, float]  # rank -> s from the cut to its DistBackendError
    errors: dict[int, str]
    exited: dict[int, bool]  # rank -> exited by itself within the time allowed


@pytest.fixture(scope="module", params=[False, True], ids=["host-side", "switch-side"])
def cut(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
        impairable: None) -> Cut:
    """4 ranks all-reduce in a loop over the lossy, slow network until rank 2's link
    goes down (its own interface or its switch port).  Survivors get timeout + 5 s,
    the cut-off rank 2 * timeout + 5 s (its timeout, then its store's) to exit."""
    timeout, victim = 5.0, 2  # not rank 0: its namespace holds the store
    at_switch = request.param
    with SlowNet(ranks=4, rate="1gbit", delay=LINK_DELAY, loss=LINK_LOSS) as net:
        ranks = Ranks(net, tmp_path_factory.mktemp("cut"), "link_down", str(timeout))
        ranks.wait_for("READY", timeout=60)  # the group is up, a first all-reduce passed
        cut_at = time.monotonic()
        net.set_link(victim, False, at_switch=at_switch)
        survivors = [r for r in range(net.ranks) if r != victim]
        hung = ranks.wait_exit(survivors, timeout + 5)
        hung += ranks.wait_exit([victim], cut_at + 2 * timeout + 5 - time.monotonic())
        reports = {r: json.loads(line.split(" ", 1)[1]) for r, line in ranks.first("FAILED ").items()}
    result = Cut(victim, timeout, {r: f["failed_at"] - cut_at for r, f in reports.items()},
                 {r: f["error"] for r, f in reports.items()},
                 {r: r not in hung for r in range(net.ranks)})
    side = "switch port" if at_switch else "own interface"
    for r in range(net.ranks):
        if r in reports:
            f = reports[r]
            print(f"\n[{side} of rank {victim} down] rank {r}: DistBackendError "
                  f"{result.failed_after[r]:.2f} s after the cut ({f['in_call']:.2f} s into its "
                  f"all-reduce), exited: {result.exited[r]}: {f['error'][:300]}")
        else:
            print(f"\n[{side} of rank {victim} down] rank {r}: no error, "
                  f"{'exited' if result.exited[r] else 'hung, killed'}: "
                  + " | ".join(ranks.output[r][-3:])[:300])
    return result


def test_cut_link_survivors_raise_within_timeout(cut: Cut) -> None:
    for r, exited in cut.exited.items():
        if r != cut.rank:
            assert r in cut.failed_after, f"rank {r} raised no DistBackendError"
            assert cut.failed_after[r] < cut.timeout + 3, f"rank {r} took {cut.failed_after[r]:.2f} s"
            assert exited, f"rank {r} hung after its error"


def test_cut_link_survivors_name_the_cut_rank(cut: Cut) -> None:
    """Every survivor leads with the cut-off rank as the likely cause (docs/failure-modes.md),
    not merely mentions it somewhere: a survivor that waited for it names it further on anyway."""
    for r in cut.exited:
        if r != cut.rank:
            assert r in cut.errors, f"rank {r} raised no DistBackendError"
            headline = cut.errors[r].split("] ", 1)[-1].split(";")[0]  # after "[ddlcomm rank r/n]"
            assert f"likely cause: rank {cut.rank} was not waiting" in headline, \
                f"rank {r}'s error does not lead with rank {cut.rank}: {cut.errors[r]}"


def test_cut_link_cut_rank_raises(cut: Cut) -> None:
    assert cut.rank in cut.failed_after, f"rank {cut.rank} (cut off) raised nothing"
    assert cut.exited[cut.rank], f"rank {cut.rank} (cut off) hung"


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
    # The unprivileged user must be able to import the package (torch and ddlcomm included).
    probe = subprocess.run([*nobody, *CLI, "--help"], capture_output=True,
                           timeout=60) if shutil.which("setpriv") else None
    if os.geteuid() != 0 or probe is None or probe.returncode != 0:
        pytest.skip("cannot run the command line as an unprivileged user here")
    p = subprocess.run([*nobody, *CLI, "--ranks", "2", "--", "true"],
                       capture_output=True, text=True, timeout=60)
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
