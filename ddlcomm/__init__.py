"""ddlcomm: a compiled communication and gradient-compression backend for torch.distributed.

Importing this package registers the ``"ddlcomm"`` backend. ``import torch`` imports it by
itself (the ``torch.backends`` entry point in ``ddlcomm_autoload``), so this is optional::

    import ddlcomm  # noqa: F401
    import torch.distributed as dist
    dist.init_process_group("ddlcomm")          # or "cpu:ddlcomm"

Launch with ``torchrun`` like any other backend.
"""

from __future__ import annotations

import atexit
import importlib.metadata
import importlib.util
import os
import sys
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

try:
    from . import _C
except ImportError:
    if importlib.util.find_spec("._C", __name__) is not None:
        raise  # the extension is there but does not load: its own message says why
    # Python's message blames a circular import. What happened: this directory (e.g. the root of a
    # clone after a non-editable `pip install .`) shadows the installed package.
    raise ImportError(
        f"ddlcomm was imported from {os.path.dirname(__file__)}, which has no compiled extension "
        "(ddlcomm/_C*.so): a source checkout that shadows the installed ddlcomm, e.g. because Python "
        "runs in the checkout's root. Run Python from another directory, or install the checkout in "
        "editable mode (`bash scripts/setup.sh`, or `pip install --no-build-isolation -e .` in its root), "
        "which makes it importable as it is."
    ) from None

__all__ = ["BACKEND_NAME", "ProcessGroupDdlcomm", "is_available", "transports"]

__version__ = importlib.metadata.version("ddlcomm")  # pyproject.toml's version, as installed
BACKEND_NAME = "ddlcomm"
ProcessGroupDdlcomm = _C.ProcessGroupDdlcomm


def _create_backend(dist_backend_opts: Any, backend_options: Any = None) -> ProcessGroupDdlcomm:
    """Backend creator called by torch.distributed (extended API)."""
    opts = dist_backend_opts
    timeout = opts.timeout if isinstance(opts.timeout, timedelta) else timedelta(seconds=float(opts.timeout))
    backend = ProcessGroupDdlcomm(
        opts.store,
        opts.group_rank,
        opts.group_size,
        timeout,
        [int(r) for r in opts.global_ranks_in_group],
        str(opts.group_id),
    )
    _set_default_backend_type(sys._getframe(1).f_locals.get("pg"))
    return backend


def _set_default_backend_type(pg: Any) -> None:
    # For a "device:backend" string ("cpu:ddlcomm") torch (2.13 at least) never sets the group's
    # default backend type: _new_process_group_helper compares the first key of
    # Backend._plugins, upper case ("DDLCOMM"), with the lower-case backend names. The group then
    # calls itself "undefined", and destroy_process_group warns "No backend of type 0 found".
    # `pg` is the group being created, a local of the caller; anything else is left alone.
    if isinstance(pg, dist.ProcessGroup) and pg.name() == "undefined":
        pg._set_default_backend(dist.ProcessGroup.BackendType.CUSTOM)


def transports() -> list[str]:
    """The transports this build can use, as named by ``DDLCOMM_TRANSPORT``: ``tcp`` and ``shm``
    always, ``ucx`` when UCX was found (pkg-config) when ddlcomm was built. ``auto``, the
    default, picks among them per pair of ranks (docs/transports.md)."""
    return list(_C._transports())


def is_available() -> bool:
    """True when the backend is registered with torch.distributed."""
    return BACKEND_NAME in dist.Backend.backend_list


def _destroy_at_exit() -> None:
    # Process groups left alive would otherwise be destroyed during interpreter teardown,
    # when their progress threads can no longer be joined safely.
    if dist.is_initialized():
        dist.destroy_process_group()


if BACKEND_NAME not in dist.Backend.backend_list:
    # CUDA tensors go through pinned host memory (csrc/torch/device_staging.h), on a torch with CUDA.
    _DEVICES = ["cpu", "cuda"] if torch.backends.cuda.is_built() else ["cpu"]
    dist.Backend.register_backend(BACKEND_NAME, _create_backend, extended_api=True, devices=_DEVICES)
    atexit.register(_destroy_at_exit)
