"""Compressed training under torchrun, resuming from per-rank checkpoints: run by
tests/test_elastic.py and bench.elastic_soak with `--max-restarts`, where ranks exit
hard in the first attempts.

    torchrun --nproc-per-node N elastic.py CHECKPOINT_DIR RESULT_FILE STEPS [KILL_AT [PATH]]

PATH: "ddp-onebit" (default), "ddp-ternary", "ddp-topk", "ddp-fp16" (DDP with that hook and
optimizer=ddlcomm.optim.SGD), or "fsdp-onebit" (FSDP2 with compress_gradients and SGD's
momentum in the reduce-scatter). Every rank saves its model, optimizer and compression state
every SAVE_EVERY steps; a (re)started attempt resumes from the newest step every rank saved.
In attempt a < KILLS (env ELASTIC_KILLS, default 1), rank (a + 1) % N exits with os._exit(9)
at step KILL_AT + a * SAVE_EVERY. Each rank prints its RSS at every checkpoint; rank 0 writes
the final parameters (gathered) to RESULT_FILE.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ddlcomm import compressors, fsdp, hooks, optim

SAVE_EVERY = 5
COMPRESSORS = {
    "onebit": compressors.OneBit,
    "ternary": compressors.Ternary,
    "topk": lambda: compressors.TopK(ratio=0.05),
    "fp16": compressors.FP16,
}


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _training(path: str):
    """(model to step, optimizer, compression state, the model for the forward pass)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    kind, name = path.split("-")
    if kind == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        fully_shard(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        state = fsdp.compress_gradients(model, COMPRESSORS[name](), start_compress_iter=2, min_compression_bytes=0,
                                        momentum=0.9)
        return model, opt, state, model
    opt = optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    state = hooks.CompressionState(None, COMPRESSORS[name](), start_compress_iter=2, min_compression_bytes=0, optimizer=opt,
                                   model=model)
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.05)
    ddp.register_comm_hook(state, hooks.compressed_hook)
    return model, opt, state, ddp


def main() -> None:
    folder, result, steps = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
    kill_at = int(sys.argv[4]) if len(sys.argv) > 4 else -1
    path = sys.argv[5] if len(sys.argv) > 5 else "ddp-onebit"
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    kills = int(os.environ.get("ELASTIC_KILLS", "1"))
    faulthandler.dump_traceback_later(120, exit=True)  # a hang (a stale address, say) fails the run
    dist.init_process_group("ddlcomm")
    rank, n = dist.get_rank(), dist.get_world_size()
    logging.getLogger("ddlcomm").setLevel(logging.ERROR)
    model, opt, state, forward = _training(path)

    # The newest step that every rank saved.
    mine = max((int(p.stem.split("-")[1]) for p in folder.glob(f"rank{rank}-*.pt")), default=0)
    first = torch.tensor([mine])
    dist.all_reduce(first, op=dist.ReduceOp.MIN)
    first = int(first.item())
    if first:
        saved = torch.load(folder / f"rank{rank}-{first}.pt", weights_only=False)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        state.load_state_dict(saved["state"])
    print(f"rank {rank} attempt {attempt}: from step {first}", flush=True)

    victim = (attempt + 1) % n if attempt < kills else -1
    g = torch.Generator()
    centers = torch.randn(10, 64, generator=torch.Generator().manual_seed(0)) * 0.25
    for step in range(first, steps):
        if rank == victim and step == kill_at + attempt * SAVE_EVERY:
            os._exit(9)
        g.manual_seed(step * 97 + rank)
        y = torch.randint(0, 10, (32,), generator=g)
        x = centers[y] + torch.randn(32, 64, generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(forward(x), y).backward()
        opt.step()
        if (step + 1) % SAVE_EVERY == 0:
            saved_path = folder / f"rank{rank}-{step + 1}.pt"
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "state": state.state_dict()},
                       saved_path.with_suffix(".tmp"))
            os.replace(saved_path.with_suffix(".tmp"), saved_path)
            print(f"rank {rank} attempt {attempt} step {step + 1}: rss {_rss_mib():.1f} MiB", flush=True)
    params = [p.full_tensor() if hasattr(p, "full_tensor") else p.detach() for p in model.parameters()]
    if rank == 0:
        torch.save(torch.cat([p.flatten() for p in params]), result)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
