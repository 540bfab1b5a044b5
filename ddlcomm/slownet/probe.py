"""What this machine supports: root, iproute2, network namespaces, the netem and tbf qdiscs,
and an iptables that can add the delay/loss fixture's rules, with the packet delayer able to
bind its queue (netfilter.py). Found once with a throwaway namespace (``SlowNet.probe``,
``SlowNet.available``). The standard library only."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass

from .commands import SlowNetError, sh
from .netfilter import Netfilter
from .netns import unique_name


@dataclass(frozen=True)
class Probe:
    """What this machine supports (see SlowNet.probe)."""

    ok: bool
    reason: str
    netem: bool = False
    tbf: bool = False
    iptables: str | None = None  # command that can add the fixture's rules in a namespace


def missing_prerequisite() -> str | None:
    """A one-line reason why SlowNet cannot work here, or None (cheap checks)."""
    if os.geteuid() != 0:
        return "must run as root (network namespaces and tc need CAP_NET_ADMIN)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` not found on PATH (install iproute2)"
    return None


def probe_iptables(ns: str) -> str | None:
    """The first of iptables-legacy, iptables that can add the fixture's rules in ``ns``, where
    the packet delayer can bind its queue (a kernel without nfnetlink_queue cannot)."""
    rules = (["-m", "statistic", "--mode", "random", "--probability", "0.5", "-j", "DROP"],
             ["-j", "NFQUEUE", "--queue-num", "0"])
    for tool in ("iptables-legacy", "iptables"):
        if shutil.which(tool) is None:
            continue
        try:
            for rule in rules:
                sh("ip", "netns", "exec", ns, tool, "-w", "10", "-A", "OUTPUT", *rule)
        except SlowNetError:
            continue
        fixture = Netfilter(tool)
        try:
            fixture.start_delayer(ns, 0.001)
        except SlowNetError:
            return None
        finally:
            fixture.close()
        return tool
    return None


def run_probe() -> Probe:
    """Check root, iproute2, netns and the netem/tbf qdiscs in a throwaway namespace, which is
    deleted again before returning."""
    missing = missing_prerequisite()
    if missing:
        return Probe(False, missing)
    ns = unique_name("probe")
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


def no_netem(p: Probe) -> str:
    """Why delay/loss do not come from netem, when the tbf shaper is active."""
    return ("the tbf shaper was chosen" if p.netem
            else "this kernel lacks the netem qdisc (CONFIG_NET_SCH_NETEM)")
