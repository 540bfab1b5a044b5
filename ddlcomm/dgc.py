"""DGC's corrections for the DDP hooks' sparse compressors without ``optimizer=`` (Lin et al.,
"Deep Gradient Compression", 2018): momentum correction with factor masking, and local clipping.

Without them, top-k and random-k under momentum SGD apply momentum to sparse, delayed updates.
With ``momentum=`` each rank accumulates its own velocity ``v = m v + g`` and sends it through
the compressor; the entries it sent restart from zero (their residual is zero), so a sent
gradient does not keep pushing through a stale velocity. ``clip_norm=`` clips each rank's
bucket to ``clip_norm / sqrt(world_size)`` before it accumulates, so that the sum over ranks
stays within ``clip_norm``. ``CompressionState(momentum=, clip_norm=)`` builds one.
"""

from __future__ import annotations

import logging
import math
from typing import Optional

import torch

from .compressors import Compressor

__all__ = ["DgcCorrection"]

logger = logging.getLogger("ddlcomm.hooks")


class DgcCorrection:
    """DGC's momentum correction (``momentum``) and local clipping (``clip_norm``).

    Args:
        momentum: the velocity's factor, in (0, 1).
        clip_norm: the clipping norm of the sum over ranks, or None.
        compressor: the hook's compressor: a sparse one (top-k, random-k), which sends some
            entries whole and leaves the others in the residual.
    """

    def __init__(self, momentum: float, clip_norm: Optional[float], compressor: Compressor) -> None:
        if not momentum:
            raise ValueError("clip_norm= is DGC's local clipping, for momentum=; it is not clip_grad_norm_. To "
                             "clip as torch does, call torch.nn.utils.clip_grad_norm_ between backward() and "
                             "step(): it works with FP16()/BF16() and with hooks that have no optimizer=")
        if not compressor.is_sparse:
            raise ValueError(f"momentum= is DGC's momentum correction for sparse compressors (TopK, RandomK); "
                             f"{type(compressor).__name__} sends every entry each step: use optimizer= instead")
        if clip_norm is not None and not clip_norm > 0:
            raise ValueError(f"clip_norm must be positive, got {clip_norm}")
        self.momentum = momentum
        self.clip_norm = clip_norm
        logger.warning("ddlcomm hook: DGC's momentum= lost accuracy on both SGD recipes of docs/results/recipes.md "
                       "(top-k 1%% DGC); optimizer=ddlcomm.optim.SGD(...) averages update directions instead, and "
                       "kept it with Ternary() and top-k")

    def clip(self, buffer: torch.Tensor, world: int) -> None:
        """Scales this rank's bucket to norm ``clip_norm / sqrt(world)`` at most, in place."""
        if self.clip_norm is None:
            return
        limit = self.clip_norm / math.sqrt(world)
        norm = buffer.norm()
        if torch.isfinite(norm) and norm > limit:
            buffer.mul_(limit / norm)

    def accumulate(self, buffer: torch.Tensor, velocity: torch.Tensor, residual: torch.Tensor) -> None:
        """``velocity = momentum * velocity + buffer``, restarted at the entries sent last time
        (zero residual), and ``buffer`` becomes it: what the compressor sends."""
        velocity.masked_fill_(residual == 0, 0.0).mul_(self.momentum).add_(buffer)
        buffer.copy_(velocity)
