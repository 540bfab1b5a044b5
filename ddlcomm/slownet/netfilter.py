"""Delay and loss without netem, for the emulated network (network.py): netfilter rules and
a packet delayer in each rank's namespace.

Kernels built without netem (CONFIG_NET_SCH_NETEM unset) shape the rate with
``tbf``, which limits the rate only; delay and loss then come from netfilter,
in the INPUT chain of each rank's namespace for packets arriving on its veth
(chain SLOWNET), with what netem would do at the path's two shaped links done
at its end:

* loss: ``-m statistic --mode random --probability L -j DROP``, twice (one
  independent draw per link crossed);
* delay: ``-j NFQUEUE`` to nfq_delay.py, a process in that namespace
  that accepts each packet 2*D after it arrived, in arrival order.  The rule
  has no ``--queue-bypass``: if the delayer is gone, packets are dropped, so a
  broken fixture shows up as a dead network, never as a fast one.

Not on the sender's OUTPUT chain: a DROP there is returned to the sending
socket as an error, so TCP resends at once and never sees a loss, and packets
queued there still count against the socket's TCP small-queues budget, which
throttles throughput far below rate/RTT (netem orphans its packets; NFQUEUE
cannot).  Like netem on a veth, loss is per packet as the stack built it: a
TSO/GSO packet of up to 64 KB is dropped whole.

The rules live in the rank namespaces, so they vanish with them; the delayers
are killed and reaped on close.  ``--shaper tbf`` forces this fixture where
netem exists too.  Without netem or a working iptables (probe.py looks for
one that can add these rules), asking for delay or loss is an error rather
than being silently ignored.
"""

from __future__ import annotations

import select
import subprocess
import sys
from pathlib import Path

from .commands import SlowNetError, sh
from .units import Shaping

CHAIN = "SLOWNET"  # iptables chain of the fixture
DELAYER = Path(__file__).resolve().with_name("nfq_delay.py")


class Netfilter:
    """The fixture in the rank namespaces of one emulated network: a chain per namespace and
    its rules, and the delayers (killed and reaped by ``close``)."""

    def __init__(self, tool: str | None) -> None:
        self.tool = tool  # the iptables command the probe found, if any
        self.chains: set[str] = set()  # namespaces holding the chain
        self.delayers: dict[str, subprocess.Popen] = {}  # namespace -> nfq_delay.py

    def iptables(self, ns: str, *args: str) -> str:
        """Run the probed iptables tool with ``args`` in ``ns``; return its output."""
        tool = self.tool
        assert tool, "SlowNet allows the fixture only with iptables"
        # -w: the xtables lock file is shared by all namespaces.
        return sh("ip", "netns", "exec", ns, tool, "-w", "10", *args)

    def apply(self, links: list[tuple[str, str]], s: Shaping) -> None:
        """Make every path drop and delay as its two netem links would under ``s``.

        INPUT -i veth jumps to chain SLOWNET, which drops at random once per
        link crossed, then queues to the namespace's delayer (2 * delay).
        """
        for ns, dev in links:
            if ns in self.chains:
                self.iptables(ns, "-F", CHAIN)
            elif s.delay_s or s.loss_pct:
                self.iptables(ns, "-N", CHAIN)
                self.iptables(ns, "-A", "INPUT", "-i", dev, "-j", CHAIN)
                self.chains.add(ns)
            self.stop_delayer(ns)
            for _link in range(2 if s.loss_pct else 0):
                self.iptables(ns, "-A", CHAIN, "-m", "statistic", "--mode", "random",
                               "--probability", f"{s.loss_pct / 100:.6f}", "-j", "DROP")
            if s.delay_s:
                self.start_delayer(ns, 2 * s.delay_s)
                # No --queue-bypass: without the delayer, packets drop (fail closed).
                self.iptables(ns, "-A", CHAIN, "-j", "NFQUEUE", "--queue-num", "0")

    def start_delayer(self, ns: str, delay_s: float) -> None:
        """Start nfq_delay.py in ``ns``; return once it has bound queue 0."""
        proc = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, str(DELAYER),
                                 "--queue", "0", "--delay", repr(delay_s)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.delayers[ns] = proc  # its stdin is its lifeline: it exits when we die
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 10.0)
        line = proc.stdout.readline().strip() if ready else "no answer within 10 s"
        if line != "ready":
            self.stop_delayer(ns)
            raise SlowNetError(f"packet delayer in {ns} failed: "
                               f"{line or f'exited with {proc.returncode}'}")

    def stop_delayer(self, ns: str) -> None:
        """Kill and reap ``ns``'s delayer, if any (its queue then drops packets)."""
        proc = self.delayers.pop(ns, None)
        if proc is None:
            return
        proc.kill()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            print(f"[slownet] cleanup: delayer {proc.pid} in {ns} did not die", file=sys.stderr)
        assert proc.stdin and proc.stdout
        proc.stdin.close()
        proc.stdout.close()

    def close(self) -> None:
        for ns in list(self.delayers):
            self.stop_delayer(ns)

    def dropped_packets(self) -> int:
        """Packets dropped by the loss rules and by full or unbound delay queues."""
        total = 0
        for ns in self.chains:
            rules = self.iptables(ns, "-L", CHAIN, "-v", "-x", "-n")
            total += sum(int(line.split()[0]) for line in rules.splitlines()[2:]
                         if line.split()[2] == "DROP")
            if ns not in self.delayers:
                continue
            # Per queue: ..., queue_dropped, user_dropped, id_sequence, 1 (nfnetlink_queue.c).
            queues = sh("ip", "netns", "exec", ns, "cat", "/proc/net/netfilter/nfnetlink_queue")
            total += sum(int(f[5]) + int(f[6]) for f in map(str.split, queues.splitlines()))
        return total
