"""DDP with the 1-bit hook under torchrun, resuming from per-rank checkpoints: run by
tests/test_elastic.py with `--max-restarts`, where one rank exits hard in the first attempt.

    torchrun --nproc-per-node N elastic.py CHECKPOINT_DIR RESULT_FILE STEPS [KILL_AT]

Every rank saves its model, optimizer and hook state every SAVE_EVERY steps; a (re)started
attempt resumes from the newest step every rank saved. In attempt 0, rank 1 exits with
os._exit(9) at step KILL_AT. Rank 0 writes the final parameters to RESULT_FILE.
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

from ddlcomm import compress, hooks, optim

SAVE_EVERY = 5


def main() -> None:
    folder, result, steps = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
    kill_at = int(sys.argv[4]) if len(sys.argv) > 4 else -1
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    faulthandler.dump_traceback_later(120, exit=True)  # a hang (a stale address, say) fails the test
    dist.init_process_group(os.environ.get("ELASTIC_BACKEND", "ddlcomm"))
    rank = dist.get_rank()
    logging.getLogger("ddlcomm").setLevel(logging.ERROR)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    opt = optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    state = hooks.CompressionState(None, compress.OneBit(), start_compress_iter=2, min_compression_bytes=0,
                                   optimizer=opt, model=model)

    # The newest step that every rank saved.
    mine = max((int(p.stem.split("-")[1]) for p in folder.glob(f"rank{rank}-*.pt")), default=0)
    first = torch.tensor([mine])
    dist.all_reduce(first, op=dist.ReduceOp.MIN)
    first = int(first.item())
    if first:
        saved = torch.load(folder / f"rank{rank}-{first}.pt", weights_only=False)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        state.load_state_dict(saved["hook"])
    print(f"rank {rank} attempt {attempt}: from step {first}", flush=True)
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.05)
    ddp.register_comm_hook(state, hooks.onebit_hook)

    g = torch.Generator().manual_seed(1 + rank)
    centers = torch.randn(10, 64, generator=torch.Generator().manual_seed(0)) * 0.25
    for step in range(first, steps):
        if attempt == 0 and rank == 1 and step == kill_at:
            os._exit(9)
        g.manual_seed(step * 97 + rank)
        y = torch.randint(0, 10, (32,), generator=g)
        x = centers[y] + torch.randn(32, 64, generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
        if (step + 1) % SAVE_EVERY == 0:
            path = folder / f"rank{rank}-{step + 1}.pt"
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "hook": state.state_dict()},
                       path.with_suffix(".tmp"))
            os.replace(path.with_suffix(".tmp"), path)
    if rank == 0:
        torch.save(torch.cat([p.detach().flatten() for p in model.parameters()]), result)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
