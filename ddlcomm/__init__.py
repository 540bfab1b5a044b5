"""ddlcomm: a compiled communication and gradient-compression backend for torch.distributed.

Importing this package registers the ``"ddlcomm"`` backend::

    import ddlcomm  # noqa: F401
    import torch.distributed as dist
    dist.init_process_group("ddlcomm")          # or "cpu:ddlcomm"

Launch with ``torchrun`` like any other backend.
"""

from __future__ import annotations

import atexit
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from . import _C

__all__ = ["BACKEND_NAME", "ProcessGroupDdlcomm", "is_available"]

BACKEND_NAME = "ddlcomm"
ProcessGroupDdlcomm = _C.ProcessGroupDdlcomm


def _create_backend(dist_backend_opts: Any, backend_options: Any = None) -> ProcessGroupDdlcomm:
    """Backend creator called by torch.distributed (extended API)."""
    opts = dist_backend_opts
    timeout = opts.timeout if isinstance(opts.timeout, timedelta) else timedelta(seconds=float(opts.timeout))
    return ProcessGroupDdlcomm(
        opts.store,
        opts.group_rank,
        opts.group_size,
        timeout,
        [int(r) for r in opts.global_ranks_in_group],
        str(opts.group_id),
    )


def is_available() -> bool:
    """True when the backend is registered with torch.distributed."""
    return BACKEND_NAME in dist.Backend.backend_list


def _destroy_at_exit() -> None:
    # Process groups left alive would otherwise be destroyed during interpreter teardown,
    # when their progress threads can no longer be joined safely.
    if dist.is_initialized():
        dist.destroy_process_group()


if BACKEND_NAME not in dist.Backend.backend_list:
    dist.Backend.register_backend(BACKEND_NAME, _create_backend, extended_api=True, devices=["cpu"])
    atexit.register(_destroy_at_exit)
