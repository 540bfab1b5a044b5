"""A Hugging Face ``Trainer`` callback that trains through a compressed DDP hook (docs/huggingface.md).

Two lines added to a Trainer script::

    from ddlcomm.huggingface import CompressionCallback
    trainer.add_callback(CompressionCallback(trainer, Ternary()))

The Trainer wraps the model in DDP (through Accelerate) and builds its optimizer inside
``train()``; the callback registers ``ddlcomm.hooks``' hook on that DDP model when training
begins (``Trainer.model_wrapped``), and attaches the Trainer's optimizer (its default AdamW, and
torch's SGD and Adam, become ``ddlcomm.optim``'s in place) so that a lossy compressor averages
update directions. ``TrainingArguments.max_grad_norm`` becomes the hook's clipping (the Trainer's
``clip_grad_norm_`` would rewrite the averaged directions in ``.grad``). Every rank saves its
compression state (error-feedback memory, and the optimizer's state where it differs between
ranks) into each checkpoint folder, as the Trainer does with its random states, and loads its
own on resume.

Importing this module imports transformers; ``ddlcomm`` itself never does.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from . import hooks, optim
from .compressors import BF16, FP16, Compressor
from .options import LogOnce
from .rank_states import RankStates

__all__ = ["CompressionCallback", "state_file"]

logger = logging.getLogger(__name__)


def state_file(checkpoint: str, rank: int) -> str:
    """Where rank ``rank`` keeps its compression state in the checkpoint folder ``checkpoint``."""
    return os.path.join(checkpoint, f"ddlcomm_compression_rank{rank}.pt")


class CompressionCallback(TrainerCallback, LogOnce):
    """Registers a ``ddlcomm.hooks`` compressed hook on the DDP model of ``trainer``.

    Args:
        trainer: the ``Trainer`` this callback is added to (``trainer.add_callback(...)``): the
            callback takes its DDP model and optimizer when training begins.
        compressor: a ``ddlcomm.compressors`` compressor (None: ``Ternary()``, the hook's
            default and the choice with AdamW: docs/choosing-a-compressor.md).
        resume_from: the checkpoint folder a resumed ``train()`` loads, where it is not
            ``<output_dir>/checkpoint-<step>`` (the Trainer's own name for it, taken by default).
        start_compress_iter, min_compression_bytes, error_feedback, adaptive, process_group:
            as ``ddlcomm.hooks.CompressionState`` takes them.

    Attributes:
        state: the ``CompressionState`` (``stats``, ``iter``, ``grad_norm``), or None before
            training or where the hook cannot run (said once, as a logging warning: a model that
            is not DDP, as with one process, FSDP or DeepSpeed).

    Raises (from ``train()``): ValueError for a ``GradScaler`` (``fp16=True``) with a lossy
    compressor, which would unscale the averaged directions in ``.grad`` (use ``bf16=True``, or
    FP16()/BF16()).
    """

    def __init__(
        self,
        trainer: Trainer,
        compressor: Optional[Compressor] = None,
        *,
        resume_from: Optional[str] = None,
        start_compress_iter: int = 10,
        min_compression_bytes: int = 64 * 1024,
        error_feedback: bool = True,
        adaptive: bool = False,
        process_group: Optional[dist.ProcessGroup] = None,
    ) -> None:
        self.trainer = trainer
        self.compressor = compressor
        self.resume_from = resume_from
        self.options: dict[str, Any] = dict(start_compress_iter=start_compress_iter,
                                            min_compression_bytes=min_compression_bytes,
                                            error_feedback=error_feedback, adaptive=adaptive)
        self.process_group = process_group
        self.state: Optional[hooks.CompressionState] = None
        self._registered: Optional[DistributedDataParallel] = None  # the DDP model the hook is on
        self._clip: Optional[tuple[TrainingArguments, float]] = None  # the max_grad_norm the hook took
        LogOnce.__init__(self, logger)

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       **kwargs: Any) -> None:
        """Registers the hook on the Trainer's DDP model, with its optimizer and clipping; on a
        resumed run, loads this rank's compression state from the checkpoint."""
        model = self.trainer.model_wrapped
        if not isinstance(model, DistributedDataParallel):
            self.state = None
            self.log_once("not-ddp", "ddlcomm.huggingface: the compressed hook does not run: the Trainer's model is a %s, "
                      "not DistributedDataParallel (one process, FSDP or DeepSpeed; on a CPU-only machine the Trainer "
                      "distributes with TrainingArguments(use_cpu=True)); training is not compressed",
                      type(model).__name__)
            return
        if model is not self._registered:  # a later train() on the same DDP model keeps its hook
            self.state = self._register(args, model)
        if state.global_step > 0:
            self._resume(args, state)
        if self.state.max_grad_norm is not None and args.max_grad_norm > 0:  # the hook clips now
            self._clip = (args, args.max_grad_norm)
            args.max_grad_norm = 0.0

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        """Gives ``TrainingArguments`` its ``max_grad_norm`` back."""
        if self._clip is not None:
            clipped, norm = self._clip
            clipped.max_grad_norm = norm
            self._clip = None

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                **kwargs: Any) -> None:
        """Writes this rank's compression state into the checkpoint folder the Trainer just wrote."""
        if self.state is None:
            return
        checkpoint = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        os.makedirs(checkpoint, exist_ok=True)
        torch.save(RankStates(self.state).local_state_dict(), state_file(checkpoint, dist.get_rank()))

    # -- helpers ---------------------------------------------------------------------------
    def _register(self, args: TrainingArguments, model: DistributedDataParallel) -> hooks.CompressionState:
        optimizer = self._optimizer()
        lossy = not isinstance(self.compressor, (FP16, BF16))
        if optimizer is not None and lossy and self.trainer.accelerator.scaler is not None:
            raise ValueError("ddlcomm.huggingface: fp16=True unscales .grad through a GradScaler, and with a lossy "
                             "compressor .grad holds averaged update directions, which it must not rewrite: use "
                             "bf16=True (no GradScaler), or the FP16()/BF16() compressor")
        clip = args.max_grad_norm if optimizer is not None and lossy and args.max_grad_norm > 0 else None
        state = hooks.CompressionState(process_group=self.process_group, compressor=self.compressor,
                                       optimizer=optimizer, model=self.trainer.model, max_grad_norm=clip,
                                       **self.options)
        model.register_comm_hook(state, hooks.compressed_hook)
        self._registered = model
        return state

    def _optimizer(self) -> Optional[torch.optim.Optimizer]:
        """The torch optimizer inside the Trainer's (Accelerate's wrapper), converted, or None."""
        inner = getattr(self.trainer.optimizer, "optimizer", self.trainer.optimizer)
        try:
            return optim.convert(inner)
        except TypeError as error:
            self.log_once("optimizer", "ddlcomm.huggingface: the hook averages gradients (with momentum or Adam this "
                      "loses accuracy): %s", error)
            return None

    def _resume(self, args: TrainingArguments, state: TrainerState) -> None:
        checkpoint = self.resume_from or os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        path = state_file(checkpoint, dist.get_rank())
        if not os.path.exists(path):
            self.log_once("resume", "ddlcomm.huggingface: resumed at step %d without a compression state (no %s): the "
                      "error-feedback memory restarts from zero; pass CompressionCallback(resume_from=) where the "
                      "checkpoint is not %s-<step> in output_dir", state.global_step, path, PREFIX_CHECKPOINT_DIR)
            return
        RankStates(self.state).load_local_state_dict(torch.load(path, map_location="cpu", weights_only=True))

