"""A PyTorch Lightning callback that trains through a compressed DDP hook (docs/lightning.md).

Two lines added to a Lightning script::

    from ddlcomm.lightning import CompressionCallback
    trainer = L.Trainer(..., strategy="ddp", callbacks=[CompressionCallback(Ternary())])

Lightning's ``DDPStrategy(ddp_comm_hook=...)`` registers a hook only on CUDA
(``DDPStrategy._register_ddp_hooks``); this callback registers ``ddlcomm.hooks``' hook on the
DDP model Lightning built, on CPU and CUDA, in ``on_fit_start``. It attaches the optimizer
``configure_optimizers`` returned (torch's SGD, Adam and AdamW become ``ddlcomm.optim``'s in
place), so that a lossy compressor averages update directions; ``Trainer(gradient_clip_val=)``
becomes the hook's ``max_grad_norm`` there (Lightning's own clipping would rewrite the averaged
directions in ``.grad``); ``accumulate_grad_batches`` needs nothing (DDP's ``no_sync`` skips the
hook until the last micro-batch). The per-rank compression state (error-feedback memory, and
the optimizer's state where it differs between ranks) travels in Lightning's checkpoints, which
rank 0 alone writes: ``state_dict`` gathers every rank's to it, and each rank loads its own.

``DiLoCoCallback`` trains with ``ddlcomm.diloco.DiLoCo`` instead (docs/lightning.md, "DiLoCo"):
Lightning's DDP model takes a hook that does not communicate, so each rank's replica steps on
its own gradient, and every ``sync_every`` optimizer steps the replicas take a compressed outer
step together.

Importing this module imports Lightning; ``ddlcomm`` itself never does.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from . import hooks, optim
from .compressors import BF16, FP16, Compressor
from .diloco import DiLoCo
from .options import LogOnce
from .rank_states import RankStates, to_cpu

__all__ = ["CompressionCallback", "DiLoCoCallback"]

logger = logging.getLogger(__name__)


class CompressionCallback(pl.Callback, LogOnce):
    """Registers a ``ddlcomm.hooks`` compressed hook on Lightning's DDP model (CPU and CUDA).

    Args:
        compressor: a ``ddlcomm.compressors`` compressor; None means ``Ternary()`` (the
            hook's default, the choice with Adam: docs/choosing-a-compressor.md).
        hook: the DDP communication hook (default ``ddlcomm.hooks.compressed_hook``).
        start_compress_iter, min_compression_bytes, error_feedback, adaptive, process_group:
            as ``ddlcomm.hooks.CompressionState`` takes them.

    Attributes:
        state: the fit's ``CompressionState`` (its ``stats``, ``iter``), or None before a fit or
            where the hook cannot run (said once, as a logging warning: a strategy without
            DDP, such as a single device, FSDP or DeepSpeed).

    Raises (from ``Trainer.fit``), where training would otherwise go silently wrong with a lossy
    compressor averaging the optimizer's update directions: ValueError for
    ``gradient_clip_algorithm="value"`` and for a ``GradScaler`` (``precision="16-mixed"``:
    use ``"bf16-mixed"``, which needs none, or ``FP16()``/``BF16()``), both of which would rewrite
    the averaged directions in ``.grad``; ValueError for a checkpoint saved on another world size.
    """

    def __init__(
        self,
        compressor: Optional[Compressor] = None,
        *,
        start_compress_iter: int = 10,
        min_compression_bytes: int = 64 * 1024,
        error_feedback: bool = True,
        adaptive: bool = False,
        process_group: Optional[dist.ProcessGroup] = None,
    ) -> None:
        super().__init__()
        self.compressor = compressor
        self.options: dict[str, Any] = dict(start_compress_iter=start_compress_iter,
                                            min_compression_bytes=min_compression_bytes,
                                            error_feedback=error_feedback, adaptive=adaptive)
        self.process_group = process_group
        self.state: Optional[hooks.CompressionState] = None
        self._loaded: Optional[dict[str, Any]] = None  # a checkpoint's entry, until the fit has taken it
        self._clip: Optional[tuple[pl.Trainer, Any]] = None  # the Trainer whose gradient_clip_val the hook took
        LogOnce.__init__(self, logger)

    # -- fit -------------------------------------------------------------------------------
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Registers the hook on the DDP model, with the optimizer and the clipping of the Trainer."""
        self.state = None
        model = trainer.strategy.model
        if not isinstance(model, DistributedDataParallel):
            self.log_once("strategy", "ddlcomm.lightning: the compressed hook does not run: %s trains without "
                      "DistributedDataParallel (a DDP hook needs strategy='ddp' on 2 or more processes); "
                      "this fit is not compressed", type(trainer.strategy).__name__)
            return
        optimizer = self._optimizer(trainer)
        directions = optimizer is not None and not isinstance(self.compressor, (FP16, BF16))
        max_grad_norm = self._clip_norm(trainer) if directions else None
        state = hooks.CompressionState(process_group=self.process_group, compressor=self.compressor,
                                       optimizer=optimizer, model=pl_module, max_grad_norm=max_grad_norm,
                                       **self.options)
        if self._loaded is not None:
            RankStates(state).load_hook_state(self._loaded)
        try:
            model.register_comm_hook(state, hooks.compressed_hook)
        except RuntimeError as error:  # DDP takes one hook: DDPStrategy(ddp_comm_hook=) registered its own
            raise ValueError("ddlcomm.lightning: DDP already has a communication hook (DDPStrategy(ddp_comm_hook=) "
                             "registers one on CUDA): pass one of the two") from error
        if max_grad_norm is not None:  # the hook clips now: Lightning's clip_grad_norm_ would refuse
            self._clip = (trainer, trainer.gradient_clip_val)
            trainer.gradient_clip_val = None
        self.state = state

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """After Lightning restored rank 0's optimizer state on every rank: this rank's own."""
        if self._loaded is not None and self.state is not None:
            RankStates(self.state).load_optimizer_state(self._loaded)
        self._loaded = None

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Gives the Trainer its ``gradient_clip_val`` back."""
        self._restore_clipping()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        """Gives the Trainer its ``gradient_clip_val`` back."""
        self._restore_clipping()

    # -- checkpoints -----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Every rank's compression state, gathered to rank 0, which alone writes Lightning's
        checkpoint (``ddlcomm.rank_states.RankStates``): the hook's ``state_dict()`` and, where
        the hook averages update directions (ranks' optimizer states differ: Adam's moments,
        top-k's momentum), the optimizer's. A collective: Lightning calls it on every rank."""
        return RankStates(self.state).state_dict() if self.state is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Keeps a checkpoint's entry; each rank takes its own part when the fit starts."""
        self._loaded = state_dict if state_dict.get("ranks") else None

    # -- helpers ---------------------------------------------------------------------------
    def _optimizer(self, trainer: pl.Trainer) -> Optional[torch.optim.Optimizer]:
        """The optimizer whose directions the hook averages, or None (the hook then averages
        gradients, which loses accuracy with momentum and Adam: said once)."""
        optimizers = trainer.optimizers
        if len(optimizers) != 1:
            self.log_once("optimizers", "ddlcomm.lightning: %d optimizers: the hook averages gradients, not one "
                      "optimizer's update directions (with momentum SGD or Adam this loses accuracy)",
                      len(optimizers))
            return None
        try:
            return optim.convert(optimizers[0])
        except TypeError as error:
            self.log_once("optimizer", "ddlcomm.lightning: the hook averages gradients: %s", error)
            return None

    def _clip_norm(self, trainer: pl.Trainer) -> Optional[float]:
        """The hook's ``max_grad_norm`` for the Trainer's clipping, where ``.grad`` will hold
        averaged directions; raises where nothing equivalent exists (value clipping, a
        GradScaler)."""
        algorithm = str(getattr(trainer.gradient_clip_algorithm, "value", trainer.gradient_clip_algorithm) or "norm")
        if getattr(trainer.precision_plugin, "scaler", None) is not None:
            raise ValueError("ddlcomm.lightning: precision='16-mixed' unscales .grad through a GradScaler, and with a "
                             "lossy compressor .grad holds averaged update directions, which it must not rewrite: use "
                             "precision='bf16-mixed' (no GradScaler), or the FP16()/BF16() compressor")
        clip = trainer.gradient_clip_val
        if not clip:
            return None
        if algorithm != "norm":
            raise ValueError(f"ddlcomm.lightning: gradient_clip_algorithm={algorithm!r} would clip the averaged update "
                             f"directions that .grad holds with a lossy compressor; the hook clips by norm "
                             f"(gradient_clip_algorithm='norm', as clip_grad_norm_ on the average gradient)")
        return float(clip)

    def _restore_clipping(self) -> None:
        if self._clip is not None:
            trainer, clip = self._clip
            trainer.gradient_clip_val = clip
            self._clip = None




# Not annotated: DDP's register_comm_hook compares the annotations with dist.GradBucket and
# Future[Tensor], and this module's (postponed) annotations are strings.
def _inner_step_hook(callback, bucket):  # noqa: ANN001, ANN201
    """``DiLoCoCallback``'s DDP hook: during the warm-up, DDP's average (a float32
    all-reduce); after it nothing is sent, and each rank keeps its own gradient (DiLoCo's inner
    steps: DDP divides by the world size only without a hook, so this is the gradient of this
    rank's micro-batches, as one process would compute it)."""
    if callback.diloco is None:
        return default_hooks.allreduce_hook(None, bucket)
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


class DiLoCoCallback(pl.Callback, LogOnce):
    """Trains a ``strategy="ddp"`` fit with ``ddlcomm.diloco.DiLoCo`` (docs/lightning.md, "DiLoCo").

    In ``on_fit_start`` it registers a hook on Lightning's DDP model that sends nothing (each
    replica's inner steps use its own gradient), and once the warm-up is over it builds
    ``DiLoCo`` over the unwrapped LightningModule and the optimizer ``configure_optimizers``
    returned; after each optimizer step (not each micro-batch, so ``accumulate_grad_batches``
    counts as DDP does) it calls ``DiLoCo.step()``.

    Args:
        compressor: how the pseudo-gradient travels (a ``ddlcomm.compressors`` compressor);
            None sends float32.
        sync_every: optimizer steps between outer steps (DiLoCo's H).
        outer_lr, outer_momentum, nesterov, error_feedback, fragments, overlap_steps,
        process_group: as ``DiLoCo`` takes them.
        warmup_steps: the first optimizer steps train as plain DDP (the hook averages the
            gradients in float32 before Lightning clips them); ``DiLoCo`` starts from their
            weights. ``DiLoCo``'s own warm-up cannot run here: its step pre-hook would average
            the gradients before Lightning's closure has computed them.
        sync_at_end: take every fragment's outer step when the fit ends (``DiLoCo.sync()``)
            unless the last step was one, so that every rank ends on the global weights.

    Attributes:
        diloco: the fit's ``DiLoCo`` (its ``stats``, ``inner_steps``, ``outer_steps``), or None
            before a fit, during the warm-up, or where it cannot run (said once, as a logging
            warning: a strategy without DDP, such as a single device, FSDP or DeepSpeed).

    Raises (from ``Trainer.fit``) ValueError where the fit would be silently wrong: a
    ``CompressionCallback`` in the same Trainer (its hook would average the gradients DiLoCo's
    inner steps must keep apart), a DDP model that already has a hook, other than one
    optimizer, and a checkpoint saved on another world size.
    """

    def __init__(
        self,
        compressor: Optional[Compressor] = None,
        *,
        sync_every: int = 100,
        outer_lr: float = 1.0,
        outer_momentum: float = 0.5,
        nesterov: bool = True,
        error_feedback: bool = True,
        fragments: int = 1,
        overlap_steps: int = 0,
        warmup_steps: int = 0,
        sync_at_end: bool = True,
        process_group: Optional[dist.ProcessGroup] = None,
    ) -> None:
        super().__init__()
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(f"warmup_steps must be an integer >= 0, got {warmup_steps!r}")
        self.options: dict[str, Any] = dict(
            compressor=compressor, sync_every=sync_every, outer_lr=outer_lr, outer_momentum=outer_momentum,
            nesterov=nesterov, error_feedback=error_feedback, fragments=fragments, overlap_steps=overlap_steps,
            process_group=process_group)
        self.warmup_steps = warmup_steps
        self.sync_at_end = sync_at_end
        self.diloco: Optional[DiLoCo] = None
        self._ddp = False  # whether this fit runs the hook
        self._loaded: Optional[dict[str, Any]] = None  # this rank's checkpoint entry, until the fit has taken it
        self._step = 0  # trainer.global_step when DiLoCo last counted a step
        LogOnce.__init__(self, logger)

    # -- fit -------------------------------------------------------------------------------
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Registers the hook that averages during the warm-up and keeps gradients local after."""
        self.diloco, self._ddp = None, False
        model = trainer.strategy.model
        if any(isinstance(c, CompressionCallback) for c in trainer.callbacks):
            raise ValueError("ddlcomm.lightning: DiLoCoCallback and CompressionCallback in one Trainer: DiLoCo's inner "
                             "steps train each replica on its own gradient, which the compressed hook would average; "
                             "pass one of the two (DiLoCoCallback(compressor=) compresses the outer steps)")
        if not isinstance(model, DistributedDataParallel):
            self.log_once("strategy", "ddlcomm.lightning: DiLoCo does not run: %s trains without DistributedDataParallel "
                      "(DiLoCoCallback needs strategy='ddp' on 2 or more processes); this fit is plain",
                      type(trainer.strategy).__name__)
            return
        if len(trainer.optimizers) != 1:
            raise ValueError(f"ddlcomm.lightning: DiLoCoCallback needs one optimizer (DiLoCo's inner optimizer), "
                             f"configure_optimizers returned {len(trainer.optimizers)}")
        try:
            model.register_comm_hook(self, _inner_step_hook)
        except RuntimeError as error:  # DDP takes one hook: DDPStrategy(ddp_comm_hook=) registered its own
            raise ValueError("ddlcomm.lightning: DDP already has a communication hook (DDPStrategy(ddp_comm_hook=) "
                             "registers one on CUDA), which DiLoCo's local inner steps cannot have") from error
        # DiLoCo averages BatchNorm's statistics at its syncs; DDP's broadcast before every
        # forward would give every replica rank 0's instead.
        model.broadcast_buffers = False
        self._ddp = True

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """After Lightning restored the loops and rank 0's weights and optimizer state: DiLoCo
        (past the warm-up), then this rank's DiLoCo state, replica and optimizer state."""
        self._step = trainer.global_step
        if self._ddp and self._step >= self.warmup_steps:
            self._build(trainer, pl_module)
        if self._loaded is not None and self.diloco is not None:
            self.diloco.load_state_dict(self._loaded["diloco"])
            with torch.no_grad():
                for p, saved in zip(pl_module.parameters(), self._loaded["replica"]):
                    p.copy_(saved)
            trainer.optimizers[0].load_state_dict(self._loaded["inner_optimizer"])
        self._loaded = None

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        """``DiLoCo.step()`` once per optimizer step (the global step advanced); at the end of
        the warm-up, DiLoCo from the weights it reached."""
        if not self._ddp or trainer.global_step == self._step:
            return
        self._step = trainer.global_step
        if self.diloco is not None:
            self.diloco.step()
        elif self._step >= self.warmup_steps:
            self._build(trainer, pl_module)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """With ``sync_at_end``: the outer step that leaves every rank on the global weights."""
        d = self.diloco
        if d is None or not self.sync_at_end:
            return
        # Whole-model syncs without overlap: right after one the replicas are on the global
        # weights already, and sync() would add an outer step of momentum alone.
        if d.overlap_steps == 0 and len(d.fragment_parameters) == 1 and d.inner_steps % d.sync_every == 0:
            return
        d.sync()

    def _build(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.diloco = DiLoCo(pl_module, trainer.optimizers[0], **self.options)

    # -- checkpoints -----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Every rank's DiLoCo state, replica and inner optimizer state, gathered to rank 0,
        which alone writes Lightning's checkpoint: between syncs the replicas differ, and the
        inner optimizers' state and the error-feedback residuals always do. A collective:
        Lightning calls it on every rank."""
        if self.diloco is None:
            return {}
        mine = to_cpu({"diloco": self.diloco.state_dict(),
                        "replica": [p.detach() for p in self.diloco.model.parameters()],
                        "inner_optimizer": self.diloco.inner_optimizer.state_dict()})
        world = dist.get_world_size()
        gathered: Optional[list[Any]] = [None] * world if dist.get_rank() == 0 else None
        dist.gather_object(mine, gathered, dst=0)
        return {"world_size": world, "ranks": gathered}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Keeps this rank's entry of a checkpoint; the fit takes it when it starts."""
        ranks = state_dict.get("ranks")
        if not ranks:
            self._loaded = None
            return
        if len(ranks) != dist.get_world_size():
            raise ValueError(f"ddlcomm.lightning: the checkpoint holds DiLoCo states of {len(ranks)} ranks, this fit "
                             f"has {dist.get_world_size()}")
        self._loaded = ranks[dist.get_rank()]
