"""Adam's moments and normalised step: the one rule that the DDP optimizers (``ddlcomm.optim``)
and the FSDP2 reduce-scatter (``ddlcomm.fsdp``'s ``adam_betas=``) both apply.

Where a compressor averages Adam's step over ``n`` ranks, each rank's second moment ``v`` comes
from its own gradients: it holds the noise of a batch ``n`` times smaller than the one Adam on
the average gradient normalises by, so steps normalised by it are too short (measured even
through fp16 in docs/choosing-a-compressor.md). The step therefore
normalises by ``v' = m^2 + (v - m^2) / n``: the variance part of ``v`` scaled back to the full
batch's. Since ``v' >= m^2`` every element's step is at most 1 in size, about where Adam's own
steps stay; where this rank's gradient is zero and the first moment is not (a dead unit, an
input its batches never use, compression error in a shared ``m``), the step is bounded instead
of ``m / eps``. With ``n = 1`` it is Adam's step with that bound.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["update_first", "update_second", "normalised_step"]


def update_first(exp_avg: torch.Tensor, grad: torch.Tensor, beta1: float) -> torch.Tensor:
    """Adam's first moment, in place, as ``torch.optim.Adam`` updates it: ``m = lerp(m, g, 1 - beta1)``."""
    return exp_avg.lerp_(grad, 1 - beta1)


def update_second(exp_avg_sq: torch.Tensor, grad: torch.Tensor, beta2: float) -> torch.Tensor:
    """Adam's second moment, in place, as ``torch.optim.Adam`` updates it: ``v = beta2 * v + (1 - beta2) * g^2``."""
    return exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)


def normalised_step(exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, step: float, beta1: float, beta2: float,
                    eps: float, ranks: int, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The bias-corrected step ``m / (sqrt(v') + eps)`` with ``v' = m^2 + max(v - m^2, 0) / ranks``
    (see the module docs), written into ``out`` (a new tensor when None; it may be ``exp_avg``'s
    own storage only if the moment is not needed afterwards)."""
    first = torch.div(exp_avg, 1 - beta1**step, out=out)
    # One temporary: m^2 is formed twice rather than kept (a fresh tensor of a large
    # parameter's size costs more than the arithmetic on a CPU: page faults).
    denom = torch.div(exp_avg_sq, 1 - beta2**step)
    denom.addcmul_(first, first, value=-1).clamp_(min=0.0).div_(ranks).addcmul_(first, first)
    return first.div_(denom.sqrt_().add_(eps))
