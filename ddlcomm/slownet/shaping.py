"""The qdisc on every shaped egress: ``netem rate R [delay D] [loss L] limit N`` where the
kernel has netem, else ``tbf`` (the rate only; delay and loss then come from netfilter.py).
Which one a network uses, and the arguments ``tc qdisc add|change ... root`` gets. The
standard library only."""

from __future__ import annotations

import math

from .commands import SlowNetUnavailable
from .probe import Probe, no_netem
from .units import Shaping

SHAPERS = ("auto", "netem", "tbf")


def resolve_shaper(requested: str, p: Probe, shaping: Shaping) -> str:
    """The qdisc to use for ``shaping`` (``requested``: one of SHAPERS) on a machine probed as
    ``p``; raise SlowNetUnavailable if none fits (with tbf, delay/loss need the iptables
    fixture)."""
    if not p.ok:
        raise SlowNetUnavailable(p.reason)
    shaper = requested if requested != "auto" else ("netem" if p.netem else "tbf")
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


def qdisc_args(shaper: str, s: Shaping) -> list[str]:
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
    # each frame in softirq on the cores the ranks run on: with a small
    # bucket that kernel work, not the rate, bounds a large all-reduce
    # well below the rate. netem passes
    # GSO packets whole too, as a NIC with TSO does.
    burst = max(int(rate_Bps * 0.0005), 2 * 65536)
    limit = max(4 << 20, int(rate_Bps * 0.05))
    return ["tbf", "rate", rate, "burst", str(burst), "limit", str(limit)]
