"""ddlcomm: a compiled communication and gradient-compression backend for torch.distributed.

Importing this package registers the ``"ddlcomm"`` backend. ``import torch`` imports it by
itself (the ``torch.backends`` entry point in ``ddlcomm_autoload``), so this is optional::

    import ddlcomm  # noqa: F401
    import torch.distributed as dist
    dist.init_process_group("ddlcomm")          # CPU and CUDA tensors; or "cpu:gloo,cuda:nccl"-style maps

A group's transport is ``DDLCOMM_TRANSPORT`` (auto by default), or its own ``pg_options``::

    dist.new_group(backend="ddlcomm", pg_options=ddlcomm.Options(transport="shm"))

Launch with ``torchrun`` like any other backend. ``ProcessGroupDdlcomm`` is the backend class
torch creates for a group (``help(ddlcomm.ProcessGroupDdlcomm)`` lists its methods); the
compressors are in ``ddlcomm.compressors``, the DDP hooks in ``ddlcomm.hooks`` with their
optimizers in ``ddlcomm.optim``, FSDP2 in ``ddlcomm.fsdp``, a slow-network emulator in
``ddlcomm.slownet``; the benchmarks are in a source checkout's ``bench/``.
"""

from __future__ import annotations

import atexit
import importlib.metadata
import importlib.util
import os
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _get_default_group as _default_group

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

# ProcessGroupDdlcomm and Options are public but not listed: help(ddlcomm) would print their
# inherited c10d methods (the module docstring names both, for help() on them).
__all__ = ["BACKEND_NAME", "all_reduce_", "is_available", "transports"]

__version__ = importlib.metadata.version("ddlcomm")  # pyproject.toml's version, as installed
BACKEND_NAME = "ddlcomm"
ProcessGroupDdlcomm = _C.ProcessGroupDdlcomm
Options = ProcessGroupDdlcomm.Options  # pg_options of a ddlcomm group


def _create_backend(dist_backend_opts: Any, backend_options: Any = None) -> ProcessGroupDdlcomm:
    """Backend creator called by torch.distributed (extended API); `backend_options` is the
    ``pg_options`` of ``init_process_group``/``new_group``."""
    if backend_options is not None and not isinstance(backend_options, Options):
        kind = type(backend_options)
        raise TypeError(f"a ddlcomm group takes pg_options=ddlcomm.Options(...) or None, not {kind.__module__}."
                        f"{kind.__qualname__}")
    global _made_groups
    _made_groups = True
    opts = dist_backend_opts
    timeout = opts.timeout if isinstance(opts.timeout, timedelta) else timedelta(seconds=float(opts.timeout))
    backend = ProcessGroupDdlcomm(
        opts.store,
        opts.group_rank,
        opts.group_size,
        timeout,
        [int(r) for r in opts.global_ranks_in_group],
        str(opts.group_id),
        backend_options,
    )
    return backend


def transports() -> list[str]:
    """The transports this build can use, as named by ``DDLCOMM_TRANSPORT`` and
    ``ddlcomm.Options(transport=)``: ``tcp`` and ``shm`` always, ``ucx`` when UCX was found
    (pkg-config) when ddlcomm was built. ``auto``, the default, picks among them per pair of
    ranks (docs/transports.md)."""
    return list(_C._transports())


def all_reduce_(
    tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """``dist.all_reduce(tensor, op, group)`` on a ddlcomm group, without torch.distributed's
    dispatch, for tensors small enough that the call's overhead is the cost: tensor-parallel
    inference, a loss or a gradient norm per step.

    The group's ddlcomm backend runs the same operation as ``dist.all_reduce``: the same
    checks and errors, in order with the group's other collectives, with the same bits. It
    skips c10d's Python and dispatcher layers, whose cost per call is the same for any backend
    (docs/results/transports.md has the figures), and with them c10d's debug tooling (the flight
    recorder, ``TORCH_DISTRIBUTED_DEBUG``). Blocking and in place; returns ``tensor``, or leaves
    it alone on a rank outside ``group``, as ``dist.all_reduce`` does.

    Raises ValueError when the group's backend for ``tensor``'s device is not ddlcomm.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"ddlcomm.all_reduce_ takes a torch.Tensor, got {type(tensor).__name__}")
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        return tensor
    pg = group if group is not None else _default_group()
    backend = pg._get_backend(tensor.device)
    if type(backend) is not ProcessGroupDdlcomm:
        raise ValueError(
            f"ddlcomm.all_reduce_ needs a group whose {tensor.device.type} backend is ddlcomm, "
            f"not {type(backend).__name__}; use torch.distributed.all_reduce for it"
        )
    backend.all_reduce_(tensor, op)
    return tensor


def is_available() -> bool:
    """True when the backend is registered with torch.distributed."""
    return BACKEND_NAME in dist.Backend.backend_list


_made_groups = False  # whether this process created a ddlcomm group (the exit grace below)
_EXIT_GRACE_S = 0.05


def _destroy_at_exit() -> None:
    # Process groups left alive would otherwise be destroyed during interpreter teardown,
    # when their progress threads can no longer be joined safely.
    if dist.is_initialized():
        dist.destroy_process_group()
    if _made_groups:
        # A gloo group the program still holds at exit may have a worker thread that releases
        # its last Work (and the tensors in it, which takes the GIL) some milliseconds after the
        # work completed; if CPython's finalization starts first, that thread is killed
        # mid-release and the process aborts ("terminate called without an active exception").
        # It is torch's race (seen with no ddlcomm group at all), made likely by a ddlcomm group
        # being destroyed much faster than a gloo one: give such threads the GIL briefly.
        time.sleep(_EXIT_GRACE_S)


if BACKEND_NAME not in dist.Backend.backend_list:
    # CUDA tensors go through pinned host memory (csrc/torch/device_staging.h), on a torch with CUDA.
    _DEVICES = ["cpu", "cuda"] if torch.backends.cuda.is_built() else ["cpu"]
    dist.Backend.register_backend(BACKEND_NAME, _create_backend, extended_api=True, devices=_DEVICES)
    atexit.register(_destroy_at_exit)
