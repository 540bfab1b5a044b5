"""FSDP2 step time of a >= 100M-parameter model on an emulated slow network, 4 ranks, one run.

    sudo python -m bench.slownet.run_fsdp_step --rates 1gbit,10gbit --out docs/results

For each link rate it builds the emulated cluster of ddlcomm.slownet (one network namespace
per host, a bridge, every link shaped with tc; one rank per host, or ``--ranks-per-host``), runs ``python -m bench.fsdp_step``
on every rank, prints the table and writes ``fsdp_step.json`` and ``fsdp_step.md`` into
--out. Options after ``--`` go to the worker (``--methods``, ``--width``, ``--depth``, ...).
The ranks allocate memory with tcmalloc (``--allocator``; see ``preload``).
Needs root and iproute2; exits non-zero with the reason when namespaces are unavailable.
"""

from __future__ import annotations

import ctypes.util
import json
import os
import sys
from pathlib import Path

from ddlcomm.slownet import SlowNet

from bench.slownet.driver import bench_parser, collect_results, require_slownet, worker_args


def table(results: list[dict]) -> str:
    rates = list(dict.fromkeys(r["rate"] for r in results))
    params = results[0]["params"]
    allocator = results[0].get("allocator", "system")
    lines = [f"| FSDP2, {params / 1e6:.1f}M parameters, 4 ranks, {allocator} | "
             + " | ".join(f"{rate}: s/step (speed-up vs gloo)" for rate in rates)
             + " | MB on the wire per rank per step | reduce-scatter ÷ | all-gather ÷ |",
             "| --- |" + " --- |" * (len(rates) + 3)]
    for method in dict.fromkeys(r["method"] for r in results):
        cells, wire, rec = [], None, None
        for rate in rates:
            rec = next((r for r in results if r["method"] == method and r["rate"] == rate), None)
            cells.append(f"{rec['seconds']:.2f} ({rec['speedup']:.1f}x)" if rec else "-")
            wire = wire or (rec and rec["wire_bytes"])
        wire_cell = f"{wire / 1e6:.0f}" if wire else "n/a"
        lines.append(f"| {method} | " + " | ".join(cells) + f" | {wire_cell} | {rec['reduce_scatter_ratio']:.1f}x | "
                     f"{rec['all_gather_ratio']:.1f}x |")
    return "\n".join(lines)


def preload(allocator: str) -> None:
    """Makes every rank use ``allocator``. FSDP2 frees and reallocates each unit's unsharded
    parameters and gradients every step; glibc returns such large blocks to the kernel, so on
    the CPU each step page-faults them in again (about half of an uncompressed step on 2
    cores). tcmalloc keeps them, as the CUDA caching allocator does on a GPU."""
    if allocator == "system":
        os.environ.pop("LD_PRELOAD", None)
        return
    library = ctypes.util.find_library("tcmalloc_minimal")
    if library is None:
        raise SystemExit("bench.slownet.run_fsdp_step: tcmalloc not found "
                         "(apt-get install libtcmalloc-minimal4, or --allocator system)")
    os.environ["LD_PRELOAD"] = library  # inherited by every rank through SlowNet.env


def main() -> None:
    parser = bench_parser(__doc__, "results", 1800, worker="bench.fsdp_step")
    parser.add_argument("--allocator", choices=("tcmalloc", "system"), default="tcmalloc",
                        help="the ranks' memory allocator (see preload)")
    parser.add_argument("--ranks-per-host", type=int, choices=(1, 2, 4), default=1,
                        help="of the 4 ranks, how many share each emulated host (shared memory between them)")
    args = parser.parse_args()
    require_slownet("bench.slownet.run_fsdp_step")
    preload(args.allocator)
    extra = worker_args(args)
    results: list[dict] = []
    for rate in args.rates.split(","):
        with SlowNet(ranks=4 // args.ranks_per_host, rate=rate) as net:
            for record in collect_results(net, [sys.executable, "-m", "bench.fsdp_step", *extra],
                                          args.timeout, rate, args.ranks_per_host):
                record["rate"] = rate
                record["ranks_per_host"] = args.ranks_per_host
                record["allocator"] = args.allocator
                results.append(record)
                wire = f"{record['wire_bytes'] / 1e6:.0f} MB" if record["wire_bytes"] else "n/a"
                print(f"  [{rate}] {record['method']:<28} {record['seconds']:7.2f} s/step  {record['speedup']:5.2f}x  "
                      f"{wire}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fsdp_step.json").write_text(json.dumps(results, indent=1))
    text = table(results)
    (out / "fsdp_step.md").write_text(text + "\n")
    print()
    print(text)
    print(f"\nwrote {out / 'fsdp_step.json'} and {out / 'fsdp_step.md'}")


if __name__ == "__main__":
    main()
