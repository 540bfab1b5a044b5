"""DDP training on the ddlcomm backend, uncompressed and through compressed hooks, side by side.

    torchrun --standalone --nproc-per-node 4 -m bench.ddp_demo

The same model (an MLP on scikit-learn's handwritten digits, ``bench.tasks``) trains
three times from the same start, SGD with momentum 0.9 and a warm-up + cosine schedule: with
DDP's plain all-reduce, then through the 1-bit and ternary hooks with ``optimizer=``. Rank 0
prints progress, then a table: how many times fewer bytes each run sent, its time per step
and its held-out accuracy. Every run checks that the replicas end bitwise identical.

On one machine the network is memory, so compression only costs time here; on a slow network
it saves time (``python -m ddlcomm.slownet``, docs/choosing-a-compressor.md).
"""

from __future__ import annotations

import argparse
import time
from typing import Optional

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import ddlcomm  # noqa: F401  (registers the backend)
from ddlcomm import compressors, hooks, optim

from bench.tasks import lr_lambda, make_task

LR = 0.4  # the digits MLP's best learning rate for plain all-reduce (docs/choosing-a-compressor.md)


def train(name: str, compressor: Optional[compressors.Compressor], steps: int) -> dict:
    """One run on every rank; returns what the table shows."""
    rank, n = dist.get_rank(), dist.get_world_size()
    task = make_task("mlp", steps=steps, batch=128 // n)  # a global batch of 128
    torch.manual_seed(0)
    model = task.model()
    ddp = DistributedDataParallel(model)
    if compressor is None:
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
        state = None
    else:
        opt = optim.SGD(model.parameters(), lr=LR, momentum=0.9)  # a drop-in torch.optim.SGD
        state = hooks.CompressionState(compressor=compressor, optimizer=opt, model=model)
        ddp.register_comm_hook(state, hooks.compressed_hook)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(steps))
    g = torch.Generator().manual_seed(1000 + rank)
    start = time.perf_counter()
    for step in range(steps):
        x, y = task.batch(g)
        opt.zero_grad()
        loss = task.loss(ddp, x, y)
        loss.backward()
        opt.step()
        schedule.step()
        if rank == 0 and (step + 1) % (steps // 4) == 0:
            print(f"  {name:<11} step {step + 1:4d}/{steps}  loss {loss.item():.3f}", flush=True)
    seconds = time.perf_counter() - start
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    replicas = [torch.empty_like(flat) for _ in range(n)]
    dist.all_gather(replicas, flat)
    if not all(torch.equal(r, flat) for r in replicas):
        raise SystemExit(f"{name}: the replicas diverged")
    return {"name": name, "traffic": state.stats.ratio if state else 1.0, "ms": 1e3 * seconds / steps,
            "accuracy": task.evaluate(model)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200, help="training steps of each run")
    args = parser.parse_args()
    dist.init_process_group("ddlcomm")
    torch.set_num_threads(1)
    rank, n = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        print(f"training the digits MLP ({args.steps} steps, {n} ranks) three ways:", flush=True)
    runs = [train("all-reduce", None, args.steps), train("1-bit", compressors.OneBit(), args.steps),
            train("ternary", compressors.Ternary(), args.steps)]
    if rank == 0:
        plain = runs[0]
        print(f"\n{'method':<12}{'traffic ÷':>11}{'ms/step':>10}{'held-out accuracy %':>21}")
        print(f"{'':<12}{'(higher:':>11}{'(lower:':>10}{'(higher: better)':>21}")
        print(f"{'':<12}{'less sent)':>11}{'faster)':>10}")
        for r in runs:
            delta = "" if r is plain else f" ({r['accuracy'] - plain['accuracy']:+.1f})"
            print(f"{r['name']:<12}{r['traffic']:>10.1f}x{r['ms']:>10.1f}{r['accuracy']:>14.1f}{delta}")
        print("\ntraffic ÷: the bytes a plain ring all-reduce would send over the run / the bytes sent, the\n"
              "10 uncompressed warm-up steps included. Replicas were bitwise identical in every run.")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
