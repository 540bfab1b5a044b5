"""DDP training on the ddlcomm backend: a small classifier on synthetic data.

    torchrun --standalone --nproc-per-node 4 -m ddlcomm.examples.ddp_demo --steps 30

Each rank trains on its own shard; rank 0 prints loss and accuracy, and the run checks
that every replica ends with bitwise identical parameters.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import ddlcomm  # noqa: F401  (registers the backend)


def synthetic_task(rank: int, samples: int = 4096, features: int = 32, classes: int = 4):
    """A linearly separable-ish task: labels from a fixed random projection, plus noise."""
    g = torch.Generator().manual_seed(0)
    projection = torch.randn(features, classes, generator=g)
    gr = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(samples, features, generator=gr)
    y = (x @ projection + 0.3 * torch.randn(samples, classes, generator=gr)).argmax(1)
    return x, y


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=128)
    args = parser.parse_args()

    dist.init_process_group("ddlcomm")
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 4))
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    x, y = synthetic_task(rank)
    start = time.perf_counter()
    for step in range(args.steps):
        idx = torch.randint(0, len(x), (args.batch,), generator=torch.Generator().manual_seed(step * n + rank))
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(ddp(x[idx]), y[idx])
        loss.backward()
        opt.step()
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            with torch.no_grad():
                accuracy = (model(x).argmax(1) == y).float().mean().item()
            print(f"step {step:3d}  loss {loss.item():.4f}  train accuracy {accuracy:.3f}", flush=True)
    elapsed = time.perf_counter() - start
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    replicas = [torch.empty_like(flat) for _ in range(n)]
    dist.all_gather(replicas, flat)
    identical = all(torch.equal(r, flat) for r in replicas)
    if rank == 0:
        print(f"{args.steps} DDP steps on {n} ranks in {elapsed:.2f} s; replicas identical: {identical}")
    dist.destroy_process_group()
    if not identical:
        raise SystemExit("replicas diverged")


if __name__ == "__main__":
    main()
