"""SlowNet: the emulated network, a star of network namespaces joined by shaped links.

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

Each veth end is shaped on egress by a root qdisc (shaping.py), so every link
is limited independently in both directions (full duplex).  A packet from rank
a to rank b crosses two shaped qdiscs: veth<a> (in a's namespace) and port<b>
(in the switch), so a round trip crosses four: RTT = 4 * delay.
"""

from __future__ import annotations

import atexit
import ipaddress
import os
import re
import signal
import subprocess
import sys
import threading
from typing import Any, Sequence

from .commands import SlowNetError, SlowNetUnavailable, sh
from .launch import DEFAULT_MASTER_PORT, kill_tree
from .netfilter import DELAYER, Netfilter
from .netns import kill_namespace_processes, unique_name
from .probe import Probe, missing_prerequisite, no_netem, run_probe
from .shaping import SHAPERS, qdisc_args, resolve_shaper
from .units import Shaping

BRIDGE = "br0"
DEFAULT_SUBNET = "10.77.0.0/24"


def _raise_exit(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)


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
        if shaper not in SHAPERS:
            raise ValueError(f"shaper must be auto, netem or tbf, not {shaper!r}")
        self.shaper = shaper
        self.keep = keep
        self.prefix = unique_name()
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
            cls._probe = run_probe()
        return cls._probe

    @classmethod
    def available(cls) -> tuple[bool, str]:
        """(usable, reason): root + iproute2 + netns + a shaping qdisc, leaving nothing behind."""
        p = cls.probe()
        return p.ok, p.reason

    def _resolve_shaper(self, shaping: Shaping) -> str:
        """The qdisc to use for ``shaping``; raise SlowNetUnavailable if none fits."""
        return resolve_shaper(self.shaper, self.probe(), shaping)

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
        missing = missing_prerequisite()
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
        qdisc = qdisc_args(self.active_shaper, self.shaping)
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
                      f"`ip netns del NAME` or `python -m ddlcomm.slownet --cleanup-stale`",
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
                    kill_tree(p)
            for p in self._procs:
                try:
                    p.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    pass
            for ns in reversed(self.namespaces):
                kill_namespace_processes(ns)
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
        LOCAL_WORLD_SIZE=WORLD_SIZE (e.g. one GPU per rank). Each namespace is a host to
        ddlcomm (no shared memory between them), and ddlcomm is told to use TCP
        (DDLCOMM_TRANSPORT=tcp) unless the caller chose a transport, so that UCX on an RDMA
        device cannot bypass the emulated links either.
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
        qdisc = qdisc_args(shaper, shaping)
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
