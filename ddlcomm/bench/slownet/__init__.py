"""Emulate a slow cluster network on one Linux machine with network namespaces (network.py).

    python -m ddlcomm.bench.slownet --ranks 4 --rate 1gbit --delay 0.1ms -- CMD ARGS...
"""

from .network import (  # noqa: F401
    CHAIN, DEFAULT_MASTER_PORT, DEFAULT_SUBNET, DELAYER, PREFIX, Netfilter, Probe, Shaping, SlowNet,
    SlowNetError, SlowNetUnavailable, build_parser, cleanup_stale, list_namespaces, main, parse_loss,
    parse_rate, parse_time, run_ranks, sh)
