"""DDP communication hooks that send compressed gradients with error feedback.

Usage, in the style of PyTorch's ``powerSGD_hook``::

    from ddlcomm import hooks, optim
    from ddlcomm.compress import OneBit

    opt = optim.SGD(model.parameters(), lr=0.1, momentum=0.9)   # a drop-in torch.optim.SGD
    state = hooks.CompressionState(compressor=OneBit(), optimizer=opt)
    model.register_comm_hook(state, hooks.onebit_hook)

Every hook returns the average over the ranks, like DDP's default hook. With an
``optimizer`` from ``ddlcomm.optim`` (SGD, Adam, AdamW) the hook averages each rank's
update direction (its new momentum, or Adam's normalised step) rather than its gradient:
error feedback on the gradient, fed through momentum or Adam, costs accuracy at the usual
learning rates, and averaging the direction does not (``ddlcomm.optim`` says why;
``docs/choosing-a-compressor.md`` has the measurements). Without an optimizer the hook
compresses the gradient itself, which suits plain SGD.

The first ``start_compress_iter`` iterations run uncompressed (DDP rebuilds its buckets
after the first iteration, and early gradients are large and noisy). Buckets smaller
than ``min_compression_bytes`` always go uncompressed. On a ddlcomm process group the
native compressed all-reduce runs; on gloo or nccl groups the same algorithm runs over
standard collectives with bitwise the same result (``ddlcomm.compressed``).

Error-feedback memory (a worker and a server residual per bucket) is keyed by bucket
index and checked against the bucket's size. ``state_dict()`` / ``load_state_dict()``
carry it through a checkpoint. Non-finite gradients come out non-finite (so
``GradScaler`` skips the step) without poisoning the residuals.
"""

import logging
import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from .compress import BF16, FP16, Compressor, OneBit, RandomK, Ternary, TopK
from .compressed import compressed_all_reduce, server_residual_numel, wire_bytes
from .optim import DirectionOptimizer

__all__ = [
    "CompressionState",
    "CompressionStats",
    "compressed_hook",
    "onebit_hook",
    "ternary_hook",
    "topk_hook",
    "randomk_hook",
    "fp16_hook",
    "bf16_hook",
]

logger = logging.getLogger(__name__)

# 2: server residuals follow the segmented compressed all-reduce (ddlcomm.compressed).
_STATE_VERSION = 2


@dataclass
class CompressionStats:
    """Bytes this rank put on the wire, against what a plain ring all-reduce would send."""

    bytes_sent: int = 0  # everything, warm-up and small buckets included
    bytes_uncompressed: int = 0
    compressed_buckets: int = 0
    uncompressed_buckets: int = 0
    compressed_bytes_sent: int = 0  # the compressed buckets alone
    compressed_bytes_uncompressed: int = 0

    @property
    def ratio(self) -> float:
        """Uncompressed bytes per byte sent, over everything (higher is better)."""
        return self.bytes_uncompressed / self.bytes_sent if self.bytes_sent else 1.0

    @property
    def compression_ratio(self) -> float:
        """Uncompressed bytes per byte sent, over the compressed buckets alone."""
        if not self.compressed_bytes_sent:
            return 1.0
        return self.compressed_bytes_uncompressed / self.compressed_bytes_sent


class CompressionState:
    """State of a compressed DDP communication hook.

    Args:
        process_group: the group to reduce over (default: the world).
        compressor: a ``ddlcomm.compress`` compressor (``OneBit()``, ``Ternary()``,
            ``TopK(ratio=0.01)``, ``RandomK(...)``, ``FP16()``, ``BF16()``).
        start_compress_iter: iterations that run uncompressed first (at least 2: DDP
            rebuilds its buckets after the first iteration).
        min_compression_bytes: buckets smaller than this go uncompressed.
        error_feedback: keep residuals (recommended; without them 1-bit SGD diverges).
        optimizer: a ``ddlcomm.optim`` optimizer (SGD, Adam, AdamW) of the model: the hook
            then averages each rank's update direction instead of its gradient, which keeps
            the accuracy of momentum SGD and Adam (see the module docs). Recommended for
            every compressor.
        momentum: DGC momentum correction for sparse compressors without ``optimizer``:
            the momentum is accumulated locally and its sent entries are cleared (momentum
            factor masking). Use it with a plain SGD optimizer without momentum.
        clip_norm: DGC local gradient clipping: each rank clips its bucket's gradient to
            norm ``clip_norm / sqrt(world_size)`` before accumulating it.
    """

    def __init__(
        self,
        process_group: Optional[dist.ProcessGroup] = None,
        compressor: Optional[Compressor] = None,
        start_compress_iter: int = 10,
        min_compression_bytes: int = 64 * 1024,
        error_feedback: bool = True,
        optimizer: Optional[DirectionOptimizer] = None,
        momentum: float = 0.0,
        clip_norm: Optional[float] = None,
    ) -> None:
        if start_compress_iter < 2:
            raise ValueError("start_compress_iter must be at least 2: DDP rebuilds its buckets after iteration 1")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        if optimizer is not None and not isinstance(optimizer, DirectionOptimizer):
            raise TypeError(f"optimizer must come from ddlcomm.optim (SGD, Adam, AdamW: drop-in subclasses of "
                            f"torch's), got {type(optimizer).__module__}.{type(optimizer).__name__}")
        if optimizer is not None and momentum:
            raise ValueError("momentum= is DGC's local momentum for an optimizer without one; with optimizer= "
                             "the optimizer's own momentum is what the hook compresses")
        self.process_group = process_group
        self.compressor = compressor if compressor is not None else OneBit()
        self.start_compress_iter = start_compress_iter
        self.min_compression_bytes = min_compression_bytes
        self.error_feedback = error_feedback
        self.optimizer = optimizer
        self.momentum = momentum
        self.clip_norm = clip_norm
        self.iter = 0
        self._advised = False  # logged the no-optimizer advice
        self.stats = CompressionStats()
        # bucket index -> tensors, created on first compressed use of the bucket
        self.worker_residuals: dict[int, torch.Tensor] = {}
        self.server_residuals: dict[int, torch.Tensor] = {}
        self.momenta: dict[int, torch.Tensor] = {}

    # -- bookkeeping --------------------------------------------------------------------
    def _world(self) -> tuple[int, int]:
        group = self.process_group or dist.group.WORLD
        return dist.get_rank(group), dist.get_world_size(group)

    def _memory(self, store: dict[int, torch.Tensor], index: int, numel: int, what: str) -> torch.Tensor:
        memory = store.get(index)
        if memory is None or memory.numel() != numel:
            if memory is not None:
                logger.warning("ddlcomm hook: bucket %d changed size (%d -> %d); resetting its %s",
                               index, memory.numel(), numel, what)
            memory = torch.zeros(numel, dtype=torch.float32)
            store[index] = memory
        return memory

    def maybe_increase_iter(self, bucket: dist.GradBucket) -> None:
        # One iteration ends with its last bucket.
        if bucket.is_last():
            self.iter += 1

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume: iteration, residuals, momenta and statistics."""
        return {
            "version": _STATE_VERSION,
            "iter": self.iter,
            "worker_residuals": {k: v.clone() for k, v in self.worker_residuals.items()},
            "server_residuals": {k: v.clone() for k, v in self.server_residuals.items()},
            "momenta": {k: v.clone() for k, v in self.momenta.items()},
            "stats": vars(self.stats).copy(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores what ``state_dict`` returned (tensors are copied).

        A state from version 1 (saved before the compressed all-reduce ran in segments) keeps
        everything but its server residuals, which start again from zero; a state from a newer
        version raises ValueError.
        """
        version = int(state.get("version", 1))
        if version > _STATE_VERSION:
            raise ValueError(f"hook state version {version} is newer than this ddlcomm's ({_STATE_VERSION})")
        self.iter = int(state["iter"])
        for name in ("worker_residuals", "server_residuals", "momenta"):
            tensors = state.get(name, {})
            if name == "server_residuals" and version < 2 and tensors:
                # Version 1 laid a bucket's server residual out unsegmented; starting it from
                # zero costs one step's quantization error of the chunk this rank reduces.
                logger.warning("ddlcomm hook: the state is from version %d; its server residuals are reset", version)
                tensors = {}
            for index, tensor in tensors.items():
                if tensor.dtype != torch.float32 or tensor.dim() != 1:
                    raise ValueError(f"{name}[{index}] must be a 1-D float32 tensor, got {tensor.dtype} {tuple(tensor.shape)}")
            setattr(self, name, {int(k): v.clone() for k, v in tensors.items()})
        self.stats = CompressionStats(**state.get("stats", {}))

    def __getstate__(self) -> dict[str, Any]:
        # Process groups do not pickle, and the optimizer is saved by its owner (the hook
        # refuses to run until it is set again); the rest does (for torch.save of a whole state).
        state = {k: v for k, v in self.__dict__.items() if k not in ("process_group", "optimizer")}
        state["_optimizer_detached"] = self.optimizer is not None or getattr(self, "_optimizer_detached", False)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.process_group = None
        self.optimizer = None


def _allreduce_average(state: CompressionState, buffer: torch.Tensor) -> torch.futures.Future:
    rank, world = state._world()
    state.stats.uncompressed_buckets += 1
    nbytes = buffer.numel() * buffer.element_size()
    ring = 2 * (world - 1) * nbytes // max(world, 1)
    state.stats.bytes_sent += ring
    state.stats.bytes_uncompressed += ring
    fut = dist.all_reduce(buffer, group=state.process_group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0].div_(world))


def compressed_hook(state: CompressionState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Averages ``bucket`` over the ranks through ``state.compressor`` (see the module docs)."""
    buffer = bucket.buffer()
    nbytes = buffer.numel() * buffer.element_size()
    compress = (
        state.iter >= state.start_compress_iter
        and nbytes >= state.min_compression_bytes
        and buffer.dtype in (torch.float32, torch.float16, torch.bfloat16)
        and buffer.device.type == "cpu"
    )
    if not compress:
        fut = _allreduce_average(state, buffer)
        state.maybe_increase_iter(bucket)
        return fut

    if state.optimizer is None and getattr(state, "_optimizer_detached", False):
        # Its residuals hold errors of update directions: compressing gradients now would
        # apply them to the wrong quantity, and train worse without saying so.
        raise RuntimeError("ddlcomm hook: this CompressionState was saved with optimizer= and loaded without it; "
                           "set state.optimizer to the (loaded) ddlcomm.optim optimizer before training")
    rank, world = state._world()
    quantizer_on_gradients = state.optimizer is None and not state.momentum and not isinstance(state.compressor, (FP16, BF16))
    if quantizer_on_gradients and not getattr(state, "_advised", False):
        state._advised = True
        logger.warning("ddlcomm hook: compressing gradients with %r and no optimizer=: with momentum SGD or Adam "
                       "this loses accuracy; pass optimizer=ddlcomm.optim.SGD/Adam/AdamW(...) to average update "
                       "directions instead (docs/choosing-a-compressor.md)", state.compressor)
    index, numel = bucket.index(), buffer.numel()
    worker = server = None
    if state.error_feedback:
        worker = state._memory(state.worker_residuals, index, numel, "worker residual")
        server = state._memory(state.server_residuals, index, server_residual_numel(numel, rank, world), "server residual")
    sparse = isinstance(state.compressor, (TopK, RandomK))
    if state.clip_norm is not None:
        limit = state.clip_norm / math.sqrt(world)
        norm = buffer.norm()
        if torch.isfinite(norm) and norm > limit:
            buffer.mul_(limit / norm)
    if state.optimizer is not None:
        params = bucket.parameters()
        state.optimizer.local_directions(params, _gradients(buffer, params))
    momentum = None
    if state.momentum and sparse:
        momentum = state._memory(state.momenta, index, numel, "momentum")
        momentum.mul_(state.momentum).add_(buffer)
        buffer.copy_(momentum)

    ring = 2 * (world - 1) * nbytes // max(world, 1)
    sent = wire_bytes(state.compressor, numel, world, rank)
    state.stats.compressed_buckets += 1
    state.stats.bytes_sent += sent
    state.stats.bytes_uncompressed += ring
    state.stats.compressed_bytes_sent += sent
    state.stats.compressed_bytes_uncompressed += ring
    fut = compressed_all_reduce(
        buffer, state.compressor, worker, server, group=state.process_group, average=True,
        stream=state.iter * 65536 + index,
    )
    if momentum is not None and worker is not None:
        # Momentum factor masking: entries that were sent leave a zero residual.
        def mask(f: torch.futures.Future) -> torch.Tensor:
            momentum.masked_fill_(worker == 0, 0.0)
            return f.value()

        fut = fut.then(mask)
    state.maybe_increase_iter(bucket)
    return fut


def _gradients(buffer: torch.Tensor, params: list[torch.Tensor]) -> list[torch.Tensor]:
    """Views of the bucket's flat buffer, one per parameter, in the bucket's order."""
    if sum(p.numel() for p in params) != buffer.numel():
        raise RuntimeError(f"ddlcomm hook: a bucket of {buffer.numel()} elements holds parameters of "
                           f"{sum(p.numel() for p in params)}; cannot map its gradients to the optimizer")
    views, offset = [], 0
    for p in params:
        views.append(buffer[offset : offset + p.numel()].view_as(p))
        offset += p.numel()
    return views


def _typed_hook(expected: type, name: str):
    def hook(state: CompressionState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        if not isinstance(state.compressor, expected):
            raise TypeError(f"{name} needs a CompressionState with a {expected.__name__} compressor, "
                            f"got {type(state.compressor).__name__}")
        return compressed_hook(state, bucket)

    hook.__name__ = name
    hook.__doc__ = f"DDP hook: averages gradients through {expected.__name__} compression with error feedback."
    return hook


onebit_hook = _typed_hook(OneBit, "onebit_hook")
ternary_hook = _typed_hook(Ternary, "ternary_hook")
topk_hook = _typed_hook(TopK, "topk_hook")
randomk_hook = _typed_hook(RandomK, "randomk_hook")
fp16_hook = _typed_hook(FP16, "fp16_hook")
bf16_hook = _typed_hook(BF16, "bf16_hook")
