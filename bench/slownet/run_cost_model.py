"""The all-reduce cost model's measurements: every algorithm (bench.allreduce_algorithms)
on emulated clusters of several hosts x 2 ranks, over link rates and one-way delays.

    sudo python -m bench.slownet.run_cost_model --hosts 2,4 --rates 100mbit,1gbit,10gbit \\
        --delays 0.05ms,5ms,25ms --out docs/results/cost_model

For each (hosts, rate, delay) it builds the emulated cluster (one network namespace per host,
every link shaped with tc, shared memory inside a host), runs the worker on every rank and
appends rank 0's records, with the configuration, to ``measurements.json`` in --out (written
after every configuration, so an interrupted sweep keeps what it measured). Then
``python -m bench.cost_model --measurements DIR/measurements.json`` fits the model and
reports its errors and projections. Needs root and iproute2.
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

from ddlcomm.slownet import SlowNet

from bench.slownet.driver import bench_parser, collect_results, require_slownet, worker_args


def main() -> None:
    parser = bench_parser(__doc__, "results/cost_model", 1800, worker="bench.allreduce_algorithms")
    parser.add_argument("--hosts", default="2,4", help="comma-separated numbers of emulated hosts")
    parser.add_argument("--ranks-per-host", type=int, default=2, help="ranks in each host")
    parser.add_argument("--delays", default="0.05ms,5ms", help="comma-separated one-way delays of every link")
    parser.add_argument("--sysctl", action="append", default=[], metavar="KEY=VALUE",
                        help="set in every host's namespace before its ranks start (e.g. "
                             "net.ipv4.tcp_slow_start_after_idle=0); repeatable")
    args = parser.parse_args()
    require_slownet("bench.slownet.run_cost_model")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "measurements.json"
    records: list[dict] = []
    # Each rank sets them in its host's namespace (the same values: repeating is harmless).
    prefix = ["sh", "-c", f'sysctl -qw {" ".join(map(shlex.quote, args.sysctl))} && exec "$@"', "sh"] \
        if args.sysctl else []
    for hosts in (int(h) for h in args.hosts.split(",")):
        for rate in args.rates.split(","):
            for delay in args.delays.split(","):
                with SlowNet(ranks=hosts, rate=rate, delay=delay) as net:
                    found = collect_results(net, [*prefix, sys.executable, "-m", "bench.allreduce_algorithms",
                                                  *worker_args(args)], args.timeout, f"{hosts} hosts {rate} {delay}",
                                            args.ranks_per_host)
                for record in found:
                    record.update(hosts=hosts, ranks_per_host=args.ranks_per_host, rate=rate, delay=delay,
                                  **({"sysctl": args.sysctl} if args.sysctl else {}))
                    print(f"  [{hosts} hosts, {rate}, {delay}] {record['algorithm']:<19} {record['bytes']:>10} B "
                          f"{record['seconds']:9.4f} s", flush=True)
                records += found
                path.write_text(json.dumps(records, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
