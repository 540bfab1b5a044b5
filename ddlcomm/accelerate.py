"""A compressed DDP hook in a Hugging Face Accelerate loop (docs/accelerate.md).

After ``accelerator.prepare()``, one call::

    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    state = ddlcomm.accelerate.register_hook(accelerator, model, optimizer, Ternary())

registers ``ddlcomm.hooks``' hook on the DDP model Accelerate built, attaches the optimizer
inside Accelerate's wrapper (torch's SGD, Adam and AdamW become ``ddlcomm.optim``'s in place, so
a lossy compressor averages update directions), and registers the per-rank compression state for
``accelerator.save_state``/``load_state`` (``ddlcomm.rank_states.RankStates``: Accelerate writes
registered objects from the main process alone). Accelerate's ``DistributedDataParallelKwargs(
comm_hook=...)`` only knows torch's built-in hooks (fp16, bf16, PowerSGD).

Importing this module imports Accelerate; ``ddlcomm`` itself never does.
"""

from __future__ import annotations

import logging
import os
from typing import Optional

import accelerate
import torch
import torch.distributed as dist
from accelerate.utils import DistributedType
from torch.nn.parallel import DistributedDataParallel

from . import hooks
from .compressors import BF16, FP16, Compressor
from .options import LogOnce
from .rank_states import RankStates

__all__ = ["register_hook"]

logger = logging.getLogger(__name__)

_once = LogOnce(logger)  # what this module says once per process


def register_hook(
    accelerator: accelerate.Accelerator,
    model: torch.nn.Module,
    optimizer: Optional[torch.optim.Optimizer] = None,
    compressor: Optional[Compressor] = None,
    *,
    max_grad_norm: Optional[float] = None,
    start_compress_iter: int = 10,
    min_compression_bytes: int = 64 * 1024,
    error_feedback: bool = True,
    adaptive: bool = False,
    process_group: Optional[dist.ProcessGroup] = None,
    checkpoint: bool = True,
) -> Optional[hooks.CompressionState]:
    """Registers a compressed hook on ``model`` (what ``accelerator.prepare`` returned).

    Args:
        accelerator: the ``Accelerator`` that prepared ``model`` and ``optimizer``.
        model: the prepared model, a ``DistributedDataParallel``.
        optimizer: the prepared optimizer (Accelerate's wrapper, or the torch optimizer in it),
            attached to the hook's state; None compresses gradients (with momentum SGD or
            Adam that loses accuracy: docs/choosing-a-compressor.md).
        compressor: a ``ddlcomm.compressors`` compressor (None: ``Ternary()``, the hook's default).
        max_grad_norm: clip as ``clip_grad_norm_`` would on the average gradient. With a lossy
            compressor and an optimizer, ``accelerator.clip_grad_norm_`` would rewrite the
            averaged update directions that ``.grad`` holds (``step()`` refuses them): pass
            the norm here instead. With FP16()/BF16() or no optimizer, clip as usual.
        start_compress_iter, min_compression_bytes, error_feedback, adaptive,
            process_group: as ``ddlcomm.hooks.CompressionState`` takes them (``process_group``
            may be a ddlcomm group beside Accelerate's gloo one: docs/accelerate.md).
        checkpoint: register the per-rank state with ``accelerator.register_for_checkpointing``.

    Returns:
        The hook's ``CompressionState`` (``stats``, ``iter``), or None where the hook cannot
        run, said once as a logging warning: Accelerate is not distributed (on CPU it is only
        with ``Accelerator(cpu=True)``), or ``model`` is not DDP (FSDP, DeepSpeed, one process).

    Raises:
        ValueError: a ``GradScaler`` (``mixed_precision="fp16"``) with a lossy compressor and an
            optimizer: it would unscale the averaged directions in ``.grad`` (use "bf16", which
            needs none, or FP16()/BF16()).
    """
    if not isinstance(model, DistributedDataParallel):
        if accelerator.distributed_type == DistributedType.NO and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            _once.log_once("not-distributed", "ddlcomm.accelerate: the compressed hook does not run: Accelerate "
                           "trains each of the %s processes alone (on CPU it distributes only with "
                           "Accelerator(cpu=True))", os.environ["WORLD_SIZE"])
        else:
            _once.log_once("not-ddp", "ddlcomm.accelerate: the compressed hook does not run: the prepared model "
                           "is a %s, not DistributedDataParallel (%s); training is not compressed",
                           type(model).__name__, accelerator.distributed_type)
        return None
    inner = getattr(optimizer, "optimizer", optimizer)  # inside accelerate.optimizer.AcceleratedOptimizer
    lossy = not isinstance(compressor, (FP16, BF16))
    if inner is not None and lossy and accelerator.scaler is not None:
        raise ValueError("ddlcomm.accelerate: mixed_precision='fp16' unscales .grad through a GradScaler, and with a "
                         "lossy compressor .grad holds averaged update directions, which it must not rewrite: use "
                         "mixed_precision='bf16' (no GradScaler), or the FP16()/BF16() compressor")
    state = hooks.CompressionState(process_group=process_group, compressor=compressor, optimizer=inner,
                                   model=model.module, max_grad_norm=max_grad_norm,
                                   start_compress_iter=start_compress_iter,
                                   min_compression_bytes=min_compression_bytes, error_feedback=error_feedback,
                                   adaptive=adaptive)
    model.register_comm_hook(state, hooks.compressed_hook)
    if checkpoint:
        accelerator.register_for_checkpointing(RankStates(state))
    return state

