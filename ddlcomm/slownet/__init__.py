"""Emulate a slow cluster network on one Linux machine with network namespaces.

Every rank ("host") gets its own network namespace, joined to the others by a bridge in a
"switch" namespace; every link is shaped in both directions by a qdisc (network.py draws it).
Shaping uses ``netem rate R [delay D] [loss L] limit N``.  Kernels built without netem
(CONFIG_NET_SCH_NETEM unset) fall back to ``tbf``, which limits the rate only; delay and
loss then come from netfilter rules and a packet delayer in each rank's namespace.

Command line (one process per rank, env:// rendezvous variables set)::

    python -m ddlcomm.slownet --ranks 4 --rate 1gbit --delay 0.1ms -- CMD ARGS...

Library::

    from ddlcomm.slownet import SlowNet

    with SlowNet(ranks=4, rate="1gbit", delay="0.1ms") as net:
        procs = [net.popen(r, argv, net.env(r, 29500)) for r in range(4)]

The parts, one concept each:

* ``units``: rates, delays and losses as tc writes them (``Shaping``);
* ``commands``: running ip/tc/iptables (``sh``) and the errors they raise;
* ``netns``: namespace names, listing, killing their processes, ``cleanup_stale``;
* ``probe``: what this machine supports (``Probe``);
* ``shaping``: the qdisc of every shaped link (netem or tbf) and its arguments;
* ``netfilter``: delay and loss without netem (iptables rules in each rank's namespace),
  with ``nfq_delay.py``, the packet delayer it starts there (a standalone script);
* ``network``: ``SlowNet``, the network itself;
* ``launch``: running a command on every rank (``run_ranks``);
* ``cli``: the command line (``__main__``).

The benchmark drivers that run on it are not part of the package: in a source checkout,
``bench/slownet/run_X`` runs the ``bench.X`` worker on 4 emulated hosts (``driver`` holds what
they share): ``run_compressed`` (compressed all-reduce and DDP hooks), ``run_fsdp_step``
(FSDP2 steps) and ``run_time_to_accuracy``, e.g., from the repository root,
``sudo python -m bench.slownet.run_fsdp_step --rates 1gbit,10gbit --out docs/results``.

Needs root and iproute2 (``ip``, ``tc``), plus iptables for delay/loss without netem
(scripts/setup.sh installs both where it can). ``--check`` with the run's ``--rate``,
``--delay``, ``--loss`` and ``--shaper`` says whether that run would start, or why not. The
emulation's modules use the standard library only (importing the package imports ddlcomm,
and with it torch).
"""

from .cli import build_parser, main
from .commands import SlowNetError, SlowNetUnavailable, sh
from .launch import DEFAULT_MASTER_PORT, run_ranks
from .netfilter import CHAIN, DELAYER, Netfilter
from .netns import PREFIX, cleanup_stale, list_namespaces
from .network import BRIDGE, DEFAULT_SUBNET, SlowNet
from .probe import Probe, no_netem, probe_iptables
from .shaping import SHAPERS
from .units import Shaping, parse_loss, parse_rate, parse_time

__all__ = [
    "BRIDGE", "CHAIN", "DEFAULT_MASTER_PORT", "DEFAULT_SUBNET", "DELAYER", "PREFIX", "SHAPERS",
    "Netfilter", "Probe", "Shaping", "SlowNet", "SlowNetError", "SlowNetUnavailable",
    "build_parser", "cleanup_stale", "list_namespaces", "main", "no_netem", "parse_loss",
    "parse_rate", "parse_time", "probe_iptables", "run_ranks", "sh",
]
