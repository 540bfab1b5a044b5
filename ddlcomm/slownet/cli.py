"""The command line (``python -m ddlcomm.slownet``): run COMMAND once per rank, each in
its own namespace of an emulated network, with the env:// rendezvous variables set."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from typing import Any, Sequence

from .commands import SlowNetError, SlowNetUnavailable
from .launch import DEFAULT_MASTER_PORT, run_ranks
from .netns import cleanup_stale
from .network import DEFAULT_SUBNET, SlowNet
from .probe import missing_prerequisite
from .shaping import SHAPERS, resolve_shaper
from .units import Shaping, parse_loss, parse_rate, parse_time


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
        prog="python -m ddlcomm.slownet",
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
    ap.add_argument("--shaper", choices=SHAPERS, default="auto",
                    help="qdisc: netem (rate+delay+loss) or tbf (rate; delay/loss then by "
                         "iptables + an NFQUEUE delayer); auto prefers netem")
    ap.add_argument("--grace", type=float, default=10.0,
                    help="seconds the other ranks get after one fails (default 10)")
    ap.add_argument("--timeout", type=float, default=600.0,
                    help="kill everything after this many seconds (default 600)")
    ap.add_argument("--keep", action="store_true", help="do not delete the namespaces (debugging)")
    ap.add_argument("--check", action="store_true",
                    help="only say whether this machine can emulate the network that --rate, --delay, --loss "
                         "and --shaper ask for (exit 0) or why not (exit 1)")
    ap.add_argument("--cleanup-stale", action="store_true",
                    help="delete ddl-* namespaces of dead processes, then run COMMAND if any")
    ap.add_argument("command", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return ap


def check(shaper: str, shaping: Shaping) -> int:
    """``--check``: whether a run with these options would start, by the same choice of shaper
    the run makes (so it never says yes to a delay that only netem or iptables could add)."""
    probe = SlowNet.probe()
    try:
        chosen = resolve_shaper(shaper, probe, shaping)
    except SlowNetUnavailable as e:
        print(f"slownet: cannot emulate the network: {e}")
        return 1
    how = chosen if chosen == "netem" or not shaping.impairment else f"tbf, {shaping.impairment} by {probe.iptables}"
    print(f"slownet: can emulate the network ({shaping}: {how})")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if args.check:
        return check(args.shaper, Shaping.parse(args.rate, args.delay, args.loss))
    if not command and not args.cleanup_stale:
        ap.error("no COMMAND given (put it after --)")
    missing = missing_prerequisite()
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
