"""Benchmarks of a source checkout (not in the wheel), each ``python -m bench.NAME`` run from
the repository root: collectives, convergence and the demo (ddp_demo) under torchrun;
compressed, fsdp_step and time_to_accuracy one process per rank, normally on the emulated
network of ``ddlcomm.slownet`` (started by ``bench.slownet.run_X``); compress_kernels
(compressor throughput, one process); soak (random collectives, every result checked);
``cuda`` for the GPU kernels."""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from typing import Optional

__all__ = ["init_ranks"]


def init_ranks(backend: str, timeout: Optional[timedelta] = None) -> None:
    """``init_process_group`` for a benchmark's ranks, or one line saying how to start them
    when the launcher's variables are missing (torch would say "RANK expected")."""
    import torch.distributed as dist

    missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
    if missing:
        spec = getattr(sys.modules["__main__"], "__spec__", None)
        module = spec.name if spec else "bench.NAME"
        raise SystemExit(f"{', '.join(missing)} not set: start this benchmark's ranks with torchrun, e.g. "
                         f"torchrun --nproc-per-node 4 -m {module} (or python -m ddlcomm.slownet -- "
                         f"torchrun ... for an emulated network)")
    dist.init_process_group(backend, **({"timeout": timeout} if timeout else {}))
