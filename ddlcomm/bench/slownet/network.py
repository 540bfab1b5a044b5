"""Emulate a slow cluster network on one Linux machine with network namespaces.

Every rank ("host") gets its own network namespace holding one end of a veth
pair.  The other ends are ports of a Linux bridge that lives in a dedicated
"switch" namespace, so the root namespace is never touched except to create
namespaces.  Names carry the creating PID so concurrent runs do not collide::

                      switch namespace  ddl-<pid>-<n>-sw
              +-------------------------------------------------+
              |                      br0                        |
              |   port0         port1        ...      port<N-1> |
              +-----|-------------|------------------------|----+
                    |             |                        |
              +-----|-----+ +-----|-----+          +-------|-----+
              |  veth0    | |  veth1    |   ...    |  veth<N-1>  |
              | 10.77.0.1 | | 10.77.0.2 |          | 10.77.0.<N> |
              +-----------+ +-----------+          +-------------+
               ddl-..-r0     ddl-..-r1              ddl-..-r<N-1>

Each veth end is shaped on egress by a root qdisc, so every link is limited
independently in both directions (full duplex).  A packet from rank a to rank
b crosses two shaped qdiscs: veth<a> (in a's namespace) and port<b> (in the
switch), so a round trip crosses four: RTT = 4 * delay.

Shaping uses ``netem rate R [delay D] [loss L] limit N``.  Kernels built
without netem (CONFIG_NET_SCH_NETEM unset) fall back to ``tbf``, which limits
the rate only; delay and loss then come from netfilter rules and a packet
delayer in each rank's namespace (netfilter.py).  Rates, delays
and losses are written as tc writes them (units.py).

Command line (one process per rank, env:// rendezvous variables set)::

    python -m ddlcomm.bench.slownet --ranks 4 --rate 1gbit --delay 0.1ms -- CMD ARGS...

Library::

    with SlowNet(ranks=4, rate="1gbit", delay="0.1ms") as net:
        procs = [net.popen(r, argv, net.env(r, 29500)) for r in range(4)]

Needs root and iproute2 (``ip``, ``tc``), plus iptables for delay/loss
without netem; the standard library only.
"""

from __future__ import annotations

import argparse
import atexit
import ipaddress
import itertools
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from typing import IO, Any, Sequence

from .netfilter import CHAIN, DELAYER, Netfilter, no_netem, probe_iptables  # noqa: F401
from .units import (  # noqa: F401  (the library's names, as before the split)
    Probe, Shaping, SlowNetError, SlowNetUnavailable, parse_loss, parse_rate, parse_time, sh)

PREFIX = "ddl"
BRIDGE = "br0"
DEFAULT_SUBNET = "10.77.0.0/24"
# Rank 0's namespace is brand new and private, so any port is free there.
DEFAULT_MASTER_PORT = 29500
_instance_ids = itertools.count()


# ---------------------------------------------------------------- helpers

def list_namespaces() -> list[str]:
    """Names of all named network namespaces (``ip netns list``)."""
    return [line.split()[0] for line in sh("ip", "netns", "list").splitlines() if line.strip()]


def _kill_namespace_processes(ns: str) -> None:
    """SIGKILL every process still living in namespace ``ns``."""
    try:
        pids = [int(p) for p in sh("ip", "netns", "pids", ns).split()]
    except SlowNetError:
        return
    for pid in pids:
        if pid != os.getpid():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup_stale() -> list[str]:
    """Delete ``ddl-<pid>-*`` namespaces whose creating process is gone."""
    removed = []
    for ns in list_namespaces():
        m = re.match(rf"{PREFIX}-(\d+)-", ns)
        if m and not _pid_alive(int(m[1])):
            _kill_namespace_processes(ns)
            sh("ip", "netns", "del", ns)
            removed.append(ns)
    return removed


def _missing_prerequisite() -> str | None:
    """A one-line reason why SlowNet cannot work here, or None (cheap checks)."""
    if os.geteuid() != 0:
        return "must run as root (network namespaces and tc need CAP_NET_ADMIN)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` not found on PATH (install iproute2)"
    return None


def _raise_exit(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)


# ---------------------------------------------------------------- SlowNet

class SlowNet:
    """A star network of ``ranks`` namespaces with shaped links; a context manager.

    ``rate``/``delay``/``loss`` apply to every link in each direction
    (tc syntax: "1gbit", "0.1ms", "0.5%").  ``shaper`` is "auto" (netem if the
    kernel has it, else tbf), "netem" or "tbf".  ``keep=True`` leaves the
    namespaces in place on exit (for debugging; see ``--cleanup-stale``).
    """

    _probe: Probe | None = None

    def __init__(self, ranks: int, rate: str = "1gbit", delay: str = "0",
                 loss: str | None = None, subnet: str = DEFAULT_SUBNET,
                 shaper: str = "auto", keep: bool = False) -> None:
        self.ranks = int(ranks)
        self.shaping = Shaping.parse(rate, delay, loss)
        self.subnet = ipaddress.ip_network(subnet)
        if self.ranks < 1:
            raise ValueError("ranks must be >= 1")
        if self.ranks + 1 >= self.subnet.num_addresses:
            raise ValueError(f"subnet {subnet} is too small for {self.ranks} ranks")
        if shaper not in ("auto", "netem", "tbf"):
            raise ValueError(f"shaper must be auto, netem or tbf, not {shaper!r}")
        self.shaper = shaper
        self.keep = keep
        self.prefix = f"{PREFIX}-{os.getpid()}-{next(_instance_ids)}"
        self.namespaces: list[str] = []  # created so far, switch first
        self._procs: list[subprocess.Popen] = []
        self._netfilter: Netfilter | None = None  # delay/loss under tbf
        self._old_handlers: dict[int, Any] = {}
        self._closed = False
        self.active_shaper: str | None = None  # resolved on entry

    # -- naming -------------------------------------------------------------

    @property
    def switch_namespace(self) -> str:
        return f"{self.prefix}-sw"

    def namespace(self, rank: int) -> str:
        """Name of ``rank``'s network namespace."""
        return f"{self.prefix}-r{self._check_rank(rank)}"

    def ifname(self, rank: int) -> str:
        """Name of ``rank``'s interface (inside its namespace)."""
        return f"veth{self._check_rank(rank)}"

    def address(self, rank: int) -> str:
        """IPv4 address of ``rank``: the subnet's (rank+1)-th host."""
        return str(self.subnet.network_address + self._check_rank(rank) + 1)

    def _check_rank(self, rank: int) -> int:
        if not 0 <= rank < self.ranks:
            raise IndexError(f"rank {rank} out of range 0..{self.ranks - 1}")
        return rank

    def _rank_links(self) -> list[tuple[str, str]]:
        """(namespace, veth) of every rank."""
        return [(self.namespace(r), self.ifname(r)) for r in range(self.ranks)]

    def _shaped_links(self) -> list[tuple[str, str]]:
        """(namespace, device) of every shaped egress: both ends of each veth."""
        links = []
        for r in range(self.ranks):
            links += [(self.namespace(r), self.ifname(r)), (self.switch_namespace, f"port{r}")]
        return links

    # -- capability checks -------------------------------------------------

    @classmethod
    def probe(cls) -> Probe:
        """Check root, iproute2, netns and the netem/tbf qdiscs (cached).

        Uses a throwaway namespace that is deleted again before returning.
        """
        if cls._probe is None:
            cls._probe = cls._run_probe()
        return cls._probe

    @staticmethod
    def _run_probe() -> Probe:
        missing = _missing_prerequisite()
        if missing:
            return Probe(False, missing)
        ns = f"{PREFIX}-{os.getpid()}-probe{next(_instance_ids)}"
        try:
            sh("ip", "netns", "add", ns)
        except SlowNetError as e:
            return Probe(False, f"cannot create a network namespace: {e}")
        try:
            sh("ip", "-n", ns, "link", "add", "name", "p0", "type", "veth", "peer", "name", "p1")
            errors = {}
            for dev, qdisc in (("p0", "netem rate 1gbit delay 1ms"),
                               ("p1", "tbf rate 1gbit burst 64kb limit 1mb")):
                try:
                    sh("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", *qdisc.split())
                except SlowNetError as e:
                    errors[qdisc.split()[0]] = str(e)
            iptables = probe_iptables(ns)
        except SlowNetError as e:
            return Probe(False, f"cannot create a veth pair: {e}")
        finally:
            try:
                sh("ip", "netns", "del", ns)
            except SlowNetError:
                pass
        netem, tbf = "netem" not in errors, "tbf" not in errors
        if netem:
            return Probe(True, "ok: root, iproute2, netns and netem available", netem, tbf, iptables)
        if tbf and iptables:
            return Probe(True, "no netem qdisc in this kernel (CONFIG_NET_SCH_NETEM): rates by "
                               f"tbf, delay/loss by {iptables} statistic + NFQUEUE delayer",
                         netem, tbf, iptables)
        if tbf:
            return Probe(True, "rate shaping only (tbf): the netem qdisc is not supported by "
                               "this kernel (CONFIG_NET_SCH_NETEM) and no working iptables "
                               "(statistic match, NFQUEUE target) was found, so delay/loss are "
                               "unavailable", netem, tbf)
        return Probe(False, f"neither netem nor tbf qdisc works: {errors['tbf']}")

    @classmethod
    def available(cls) -> tuple[bool, str]:
        """(usable, reason): root + iproute2 + netns + a shaping qdisc, leaving nothing behind."""
        p = cls.probe()
        return p.ok, p.reason

    def _resolve_shaper(self, shaping: Shaping) -> str:
        """The qdisc to use for ``shaping``; raise SlowNetUnavailable if none fits
        (with tbf, delay/loss need the iptables fixture)."""
        p = self.probe()
        if not p.ok:
            raise SlowNetUnavailable(p.reason)
        shaper = self.shaper if self.shaper != "auto" else ("netem" if p.netem else "tbf")
        if shaper == "netem" and not p.netem:
            raise SlowNetUnavailable("the netem qdisc is not supported by this kernel "
                                     "(CONFIG_NET_SCH_NETEM is not set)")
        if shaper == "tbf" and (shaping.delay_s or shaping.loss_pct) and not p.iptables:
            raise SlowNetUnavailable(f"delay/loss need netem or iptables but {no_netem(p)} and no "
                                     "working iptables was found (install the iptables package); "
                                     "only rate limiting works: use --delay 0 and no --loss")
        if shaper == "tbf" and not p.tbf:
            raise SlowNetUnavailable("the tbf qdisc is not supported by this kernel")
        return shaper

    def _qdisc_args(self, shaper: str, s: Shaping) -> list[str]:
        """tc arguments (after ``root``) for one shaped egress."""
        rate = f"{round(s.rate_bps)}bit"
        rate_Bps = s.rate_bps / 8
        if shaper == "netem":
            # Queue the bandwidth-delay product (+10 ms of queueing) twice over,
            # in packets, and never fewer than 10000 so netem itself does not drop.
            limit = max(10_000, 2 * math.ceil(rate_Bps * (s.delay_s + 0.010) / 1500))
            args = ["netem", "rate", rate]
            if s.delay_s:
                args += ["delay", f"{s.delay_s * 1e6:.3f}us"]
            if s.loss_pct:
                args += ["loss", f"{s.loss_pct:g}%"]
            return args + ["limit", str(limit)]
        # tbf: the bucket holds 0.5 ms of line rate, and at least two whole
        # 64 KiB GSO packets. tbf splits a packet bigger than its bucket into
        # 1500-byte frames, and the veth, bridge and receiving TCP then handle
        # each frame in softirq on the cores the ranks run on: at 1 Gbit/s with
        # a 62 KB bucket that kernel work, not the rate, bounded gloo's 100 MB
        # all-reduce (2.9 s instead of 1.27 s; wire time 1.2 s). netem passes
        # GSO packets whole too, as a NIC with TSO does.
        burst = max(int(rate_Bps * 0.0005), 2 * 65536)
        limit = max(4 << 20, int(rate_Bps * 0.05))
        return ["tbf", "rate", rate, "burst", str(burst), "limit", str(limit)]

    # -- lifecycle ---------------------------------------------------------

    def __enter__(self) -> "SlowNet":
        try:
            self._setup()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _setup(self) -> None:
        missing = _missing_prerequisite()
        if missing:
            raise SlowNetUnavailable(missing)
        self.active_shaper = self._resolve_shaper(self.shaping)
        atexit.register(self.close)
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGHUP):
                if signal.getsignal(sig) == signal.SIG_DFL:
                    self._old_handlers[sig] = signal.signal(sig, _raise_exit)

        sw = self.switch_namespace
        self._add_namespace(sw)
        sh("ip", "-n", sw, "link", "add", "name", BRIDGE, "type", "bridge")
        sh("ip", "-n", sw, "link", "set", "dev", BRIDGE, "up")
        qdisc = self._qdisc_args(self.active_shaper, self.shaping)
        for r in range(self.ranks):
            ns, dev, port = self.namespace(r), self.ifname(r), f"port{r}"
            self._add_namespace(ns)
            sh("ip", "-n", sw, "link", "add", "name", port, "type", "veth",
               "peer", "name", dev, "netns", ns)
            sh("ip", "-n", sw, "link", "set", "dev", port, "master", BRIDGE)
            sh("ip", "-n", sw, "link", "set", "dev", port, "up")
            sh("ip", "-n", ns, "addr", "add", f"{self.address(r)}/{self.subnet.prefixlen}", "dev", dev)
            sh("ip", "-n", ns, "link", "set", "dev", dev, "up")
            for link_ns, link_dev in ((ns, dev), (sw, port)):
                sh("tc", "-n", link_ns, "qdisc", "add", "dev", link_dev, "root", *qdisc)
        if self.active_shaper == "tbf":
            self._netfilter = Netfilter(self.probe().iptables)
            self._netfilter.apply(self._rank_links(), self.shaping)

    def _add_namespace(self, ns: str) -> None:
        try:
            sh("ip", "netns", "add", ns)
        except SlowNetError as e:
            raise SlowNetUnavailable(f"cannot create network namespace: {e}") from None
        self.namespaces.append(ns)
        sh("ip", "-n", ns, "link", "set", "dev", "lo", "up")

    def close(self) -> None:
        """Kill processes left in the namespaces and delete the namespaces
        (which deletes the veths).  Idempotent; skipped with ``keep=True``."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        for sig, old in self._old_handlers.items():
            signal.signal(sig, old)
        if self.keep:
            if self.namespaces:
                print(f"[slownet] keeping namespaces {' '.join(self.namespaces)}; remove with "
                      f"`ip netns del NAME` or `python -m ddlcomm.bench.slownet --cleanup-stale`",
                      file=sys.stderr)
            if self._netfilter and self._netfilter.delayers:
                print("[slownet] the packet delayers exit with this process; their queues "
                      "then drop all traffic", file=sys.stderr)
            return
        blocked = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
        old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, blocked)  # don't abort half-way
        try:
            if self._netfilter:
                self._netfilter.close()
            for p in self._procs:
                if p.poll() is None:
                    _kill_tree(p)
            for p in self._procs:
                try:
                    p.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    pass
            for ns in reversed(self.namespaces):
                _kill_namespace_processes(ns)
                try:
                    sh("ip", "netns", "del", ns)
                except SlowNetError as e:
                    print(f"[slownet] cleanup: {e}", file=sys.stderr)
            self.namespaces.clear()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)

    # -- using the network -------------------------------------------------

    def env(self, rank: int, master_port: int = DEFAULT_MASTER_PORT) -> dict[str, str]:
        """os.environ plus the env:// rendezvous variables for ``rank``.

        All ranks share one physical machine, so LOCAL_RANK=RANK and
        LOCAL_WORLD_SIZE=WORLD_SIZE (e.g. one GPU per rank). They could share memory too,
        which would bypass the emulated network: ddlcomm is told to use TCP
        (DDLCOMM_TRANSPORT=tcp) unless the caller chose a transport.
        """
        env = dict(os.environ)
        env.setdefault("DDLCOMM_TRANSPORT", "tcp")
        env.update(
            MASTER_ADDR=self.address(0), MASTER_PORT=str(master_port),
            RANK=str(rank), WORLD_SIZE=str(self.ranks),
            LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(self.ranks),
            DDLCOMM_SOCKET_IFNAME=self.ifname(rank), GLOO_SOCKET_IFNAME=self.ifname(rank),
        )
        return env

    def popen(self, rank: int, argv: Sequence[str], env: dict[str, str] | None = None,
              **kw: Any) -> subprocess.Popen:
        """Start ``argv`` inside ``rank``'s namespace (``ip netns exec``).

        Extra keywords go to subprocess.Popen.  Processes still running when
        the network is closed are killed.
        """
        proc = subprocess.Popen(["ip", "netns", "exec", self.namespace(rank), *argv], env=env, **kw)
        self._procs.append(proc)
        return proc

    def set_link(self, rank: int, up: bool, at_switch: bool = False) -> None:
        """Take ``rank``'s link down (unplugged cable) or bring it back up: its
        own interface, or with ``at_switch`` its switch port (the host then
        only sees the carrier go)."""
        ns, dev = ((self.switch_namespace, f"port{self._check_rank(rank)}") if at_switch
                   else (self.namespace(rank), self.ifname(rank)))
        sh("ip", "-n", ns, "link", "set", "dev", dev, "up" if up else "down")

    def set_rate(self, rate: str, delay: str = "0", loss: str | None = None) -> None:
        """Replace the shaping of every link in place (``tc qdisc change``)."""
        shaping = Shaping.parse(rate, delay, loss)
        shaper = self._resolve_shaper(shaping)
        qdisc = self._qdisc_args(shaper, shaping)
        for ns, dev in self._shaped_links():
            sh("tc", "-n", ns, "qdisc", "change", "dev", dev, "root", *qdisc)
        if shaper == "tbf":
            assert self._netfilter is not None
            self._netfilter.apply(self._rank_links(), shaping)
        self.shaping = shaping

    def dropped_packets(self) -> int:
        """Packets dropped so far by every link's qdisc (netem loss, full queues) and by the
        fixture (loss rules, full or unbound delay queues)."""
        total = 0
        for ns, dev in self._shaped_links():
            stats = sh("tc", "-s", "-n", ns, "qdisc", "show", "dev", dev)
            total += sum(int(n) for n in re.findall(r"dropped (\d+)", stats))
        if self._netfilter:
            total += self._netfilter.dropped_packets()
        return total

    def describe(self) -> str:
        """One line: topology, and how rate, delay and loss are emulated."""
        text = f"{self.ranks} ranks on {self.subnet}, star via {self.switch_namespace}, "
        shaper, s = self.active_shaper or self.shaper, self.shaping
        if shaper != "tbf" or not s.impairment:
            return text + f"{shaper} {s} per link direction"
        p = self.probe()
        return text + (f"tbf {Shaping(s.rate_bps)} per link direction; {s.impairment} "
                       f"per link direction emulated at each receiver by {p.iptables} "
                       f"(statistic match, NFQUEUE to {DELAYER.name}) because {no_netem(p)}")


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL ``proc`` and, if it leads its own process group, the whole group."""
    try:
        if os.getpgid(proc.pid) == proc.pid:
            os.killpg(proc.pid, signal.SIGKILL)
        else:
            proc.kill()
    except (ProcessLookupError, PermissionError):
        pass


# ---------------------------------------------------------------- CLI

def _pump(stream: IO[bytes], prefix: str, lock: threading.Lock, out: IO[str]) -> None:
    """Copy lines from ``stream`` to ``out``, each prefixed."""
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace").rstrip("\r\n")
        with lock:
            out.write(f"{prefix}{line}\n")
            out.flush()
    stream.close()


def _exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def run_ranks(net: SlowNet, argv: Sequence[str], master_port: int = DEFAULT_MASTER_PORT,
              timeout: float = 600.0, grace: float = 10.0, out: IO[str] | None = None,
              stop: threading.Event | None = None) -> int:
    """Run ``argv`` once per rank and stream prefixed output.

    Returns 0 if every rank exits 0, else the first non-zero exit code.  After
    a failure the other ranks get ``grace`` seconds, then are killed; after
    ``timeout`` seconds everything is killed (exit 124 unless a rank failed).
    When ``stop`` is set, every rank is killed at once (exit 130 unless a rank
    failed; the caller knows which signal set it).
    """
    out = out or sys.stdout
    lock = threading.Lock()
    procs, pumps = [], []
    for r in range(net.ranks):
        env = net.env(r, master_port)
        env.setdefault("PYTHONUNBUFFERED", "1")
        p = net.popen(r, argv, env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                      stderr=subprocess.STDOUT, start_new_session=True)
        t = threading.Thread(target=_pump, args=(p.stdout, f"[rank {r}] ", lock, out), daemon=True)
        t.start()
        procs.append(p)
        pumps.append(t)

    def log(msg: str) -> None:
        with lock:
            print(f"[slownet] {msg}", file=sys.stderr, flush=True)

    deadline, kill_at, result = time.monotonic() + timeout, None, 0
    while True:
        codes = [p.poll() for p in procs]
        for r, code in enumerate(codes):
            if code and not result:
                result, kill_at = _exit_code(code), time.monotonic() + grace
                log(f"rank {r} exited with {result}; killing the others in {grace:g}s")
        if all(code is not None for code in codes):
            break
        now = time.monotonic()
        stopped = stop is not None and stop.is_set()
        if stopped or now >= deadline or (kill_at is not None and now >= kill_at):
            if stopped:
                result = result or 130
            elif now >= deadline:
                log(f"timeout after {timeout:g}s; killing all ranks")
                result = result or 124
            for p in procs:
                if p.poll() is None:
                    _kill_tree(p)
            break
        time.sleep(0.05)
    for p in procs:
        p.wait()
    for t in pumps:
        t.join(timeout=2)
    return result


def _arg(parse: Any) -> Any:
    """Wrap a parser so argparse reports its ValueError as a usage error."""
    def check(text: str) -> str:
        try:
            parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        return text
    return check


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m ddlcomm.bench.slownet",
        description="Run COMMAND once per rank, each in its own network namespace, "
                    "joined by a star of rate/delay-limited links.",
        usage="%(prog)s [options] -- COMMAND [ARGS...]")
    ap.add_argument("--ranks", type=int, default=2, help="number of ranks/hosts (default 2)")
    ap.add_argument("--rate", type=_arg(parse_rate), default="1gbit",
                    help="per-link, per-direction rate, tc syntax (default 1gbit)")
    ap.add_argument("--delay", type=_arg(parse_time), default="0",
                    help="per-link, per-direction delay, e.g. 0.1ms; RTT = 4x (default 0)")
    ap.add_argument("--loss", type=_arg(parse_loss), default=None,
                    help="per-link, per-direction loss, e.g. 0.1%%; a path crosses 2 links")
    ap.add_argument("--subnet", default=DEFAULT_SUBNET, help=f"default {DEFAULT_SUBNET}")
    ap.add_argument("--master-port", type=int, default=DEFAULT_MASTER_PORT,
                    help=f"MASTER_PORT (default {DEFAULT_MASTER_PORT}: free in the fresh namespace)")
    ap.add_argument("--shaper", choices=("auto", "netem", "tbf"), default="auto",
                    help="qdisc: netem (rate+delay+loss) or tbf (rate; delay/loss then by "
                         "iptables + an NFQUEUE delayer); auto prefers netem")
    ap.add_argument("--grace", type=float, default=10.0,
                    help="seconds the other ranks get after one fails (default 10)")
    ap.add_argument("--timeout", type=float, default=600.0,
                    help="kill everything after this many seconds (default 600)")
    ap.add_argument("--keep", action="store_true", help="do not delete the namespaces (debugging)")
    ap.add_argument("--cleanup-stale", action="store_true",
                    help="delete ddl-* namespaces of dead processes, then run COMMAND if any")
    ap.add_argument("command", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command and not args.cleanup_stale:
        ap.error("no COMMAND given (put it after --)")
    missing = _missing_prerequisite()
    if missing:
        print(f"slownet: error: {missing}", file=sys.stderr)
        return 2
    # SIGINT/SIGTERM/SIGHUP only set a flag that the rank loop polls: an exception raised
    # wherever the signal lands (inside Popen, or holding its waitpid lock) once left the
    # CLI waiting on a rank it no longer tracked.  Set-up is short and finishes first.
    stop, caught = threading.Event(), []
    def on_signal(signum: int, _frame: Any) -> None:
        caught.append(signum)
        stop.set()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_signal)
    try:
        if args.cleanup_stale:
            for ns in cleanup_stale():
                print(f"[slownet] removed stale namespace {ns}", file=sys.stderr)
            if not command:
                return 0
        with SlowNet(args.ranks, args.rate, args.delay, args.loss, args.subnet,
                     shaper=args.shaper, keep=args.keep) as net:
            print(f"[slownet] {net.describe()}", file=sys.stderr, flush=True)
            if not stop.is_set():
                code = run_ranks(net, command, args.master_port, args.timeout, args.grace, stop=stop)
    except (SlowNetError, ValueError) as e:
        print(f"slownet: error: {e}", file=sys.stderr)
        return 2
    if caught:
        print(f"[slownet] interrupted by {signal.Signals(caught[0]).name}; ranks killed, namespaces removed",
              file=sys.stderr)
        return 128 + caught[0]
    return code

