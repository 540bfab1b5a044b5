"""FSDP2 step time of a >= 100M-parameter model, timed on whatever network the ranks run on.

Launched once per rank (env:// rendezvous), normally by ``bench.slownet.run_fsdp_step``
inside the emulated hosts of ``ddlcomm.slownet``. Rank 0 prints one ``RESULT {json}``
line per method: the seconds per training step (the slowest rank's) and the bytes each rank
put on the wire in one step. Those are counted by the kernel (``/proc/net/dev``, every
interface but loopback) when the ranks have network namespaces of their own, so TCP/IP
headers, the agreement checks and FSDP2's own traffic are in them; on loopback they are
``null``.

Methods: FSDP2 on a gloo group and on the ddlcomm group (uncompressed), then on the ddlcomm
group ``ddlcomm.fsdp``'s compressed reduce-scatter (fp16, 1-bit, ternary, top-k 1%; SGD's
momentum moved into it) and its 8-bit parameter all-gather, alone and combined.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

import ddlcomm  # noqa: F401  (registers the backend)
from ddlcomm import compressors, fsdp

from bench import init_ranks

MOMENTUM = 0.9


@dataclass
class Method:
    name: str
    compressor: Optional[Callable[[], compressors.Compressor]] = None
    quantize_all_gather: bool = False
    gloo: bool = False  # FSDP2 on a gloo group (else the ddlcomm group)


METHODS = {m.name: m for m in (
    Method("gloo", gloo=True),
    Method("ddlcomm"),
    Method("fp16", compressors.FP16),
    Method("1-bit", compressors.OneBit),
    Method("ternary", compressors.Ternary),
    Method("top-k 1%", lambda: compressors.TopK(ratio=0.01, approximate=True)),
    Method("8-bit all-gather", quantize_all_gather=True),
    Method("1-bit + 8-bit all-gather", compressors.OneBit, quantize_all_gather=True),
    Method("1-bit block 64 + 8-bit all-gather", lambda: compressors.OneBit(block_size=64), quantize_all_gather=True),
    Method("ternary + 8-bit all-gather", compressors.Ternary, quantize_all_gather=True),
)}


def report(**fields) -> None:
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(fields), flush=True)


def tx_bytes() -> int:
    """Bytes this network namespace has sent on every interface but loopback."""
    total = 0
    with open("/proc/self/net/dev") as f:
        for line in f.readlines()[2:]:
            name, counters = line.split(":", 1)
            if name.strip() != "lo":
                total += int(counters.split()[8])
    return total


def make_model(width: int, depth: int, mesh: DeviceMesh) -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    layers.append(torch.nn.Linear(width, 10))
    model = torch.nn.Sequential(*layers)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def run(method: Method, gloo: dist.ProcessGroup, args: argparse.Namespace) -> dict:
    rank = dist.get_rank()
    group = gloo if method.gloo else dist.group.WORLD
    model = make_model(args.width, args.depth, DeviceMesh.from_group(group, "cpu"))
    params = sum(p.numel() for p in model.parameters())
    rs_state = ag_state = None
    if method.compressor is not None:  # SGD's momentum moves into the compressed reduce-scatter
        rs_state = fsdp.compress_gradients(model, method.compressor(), start_compress_iter=0, momentum=MOMENTUM)
    if method.quantize_all_gather:
        ag_state = fsdp.quantize_all_gather(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.0 if rs_state else MOMENTUM)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch, args.width, generator=g)
    y = torch.randint(0, 10, (args.batch,), generator=g)

    def step() -> None:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    step()  # warm-up: connections, buffers, residuals, page faults
    dist.barrier(group=gloo)
    sent = tx_bytes()
    step()
    sent = (tx_bytes() - sent) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # a host's bytes, per rank
    dist.barrier(group=gloo)
    start = time.perf_counter()
    for _ in range(args.iters):
        step()
    elapsed = torch.tensor([(time.perf_counter() - start) / args.iters])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=gloo)
    return {"method": method.name, "seconds": float(elapsed), "wire_bytes": sent or None, "params": params,
            "reduce_scatter_ratio": rs_state.stats.compression_ratio if rs_state else 1.0,
            "all_gather_ratio": ag_state.stats.compression_ratio if ag_state else 1.0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=3584, help="hidden width of the model")
    parser.add_argument("--depth", type=int, default=8, help="hidden layers (3584 x 3584 each: 8 -> 102.8M parameters)")
    parser.add_argument("--batch", type=int, default=16, help="per-rank batch")
    parser.add_argument("--iters", type=int, default=2, help="timed steps per method")
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated names from METHODS")
    args = parser.parse_args()
    names = args.methods.split(",")
    unknown = [n for n in names if n not in METHODS]
    if unknown:
        raise SystemExit(f"unknown methods {unknown}; choose from {list(METHODS)}")
    init_ranks("ddlcomm")
    gloo = dist.new_group(backend="gloo")
    torch.set_num_threads(1)
    base = None
    for name in names:
        record = run(METHODS[name], gloo, args)
        base = base or record["seconds"]
        report(**record, speedup=base / record["seconds"])
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
