"""Optimizers whose update direction a compressed DDP hook averages, for accuracy under compression.

Error feedback makes a compressed gradient correct on average over steps, not at each step.
Fed into momentum SGD or Adam, the delayed part comes back amplified: momentum repeats it for
about ``1 / (1 - momentum)`` steps, and Adam divides it by a second moment that never saw it.
At the learning rates people use, 1-bit compressed gradients then train badly or diverge
(docs/choosing-a-compressor.md has the measurements).

These optimizers are drop-in subclasses of ``torch.optim.SGD``, ``Adam`` and ``AdamW`` (same
arguments, same ``state_dict``), with one addition: a compressed hook given the optimizer
(``CompressionState(..., optimizer=opt)``) asks each rank for the direction its optimizer
would step in, given its own gradient, and averages *that* through the compressor with
error feedback. ``step()`` then applies the averaged direction on every rank. What is
compressed is what the parameters will move by, which is smooth (momentum, Adam's first
moment) or evenly scaled (Adam's normalised step), so the compression error is not amplified
afterwards:

* SGD: the direction is the new momentum ``momentum * buf + (1 - dampening) * (g + wd * p)``.
  The averaged direction becomes every rank's momentum buffer, which stays identical on all
  ranks (1-bit Adam's and Zheng et al. 2019's compressed momentum).
* Adam / AdamW with a compressor that only rounds (``FP16``, ``BF16``): the first moment is
  averaged, as SGD's momentum is. Every rank holds the same ``m`` and sends
  ``lerp(m, g, 1 - beta1)``; the decoded average is the new ``m`` on every rank, every rank
  derives the average gradient from it, ``(m_new - beta1 * m) / (1 - beta1)``, and updates one
  second moment with it. That is Adam on the average gradient up to the compressor's
  rounding, and the moments, like the parameters, are the same bits on every rank.
* Adam / AdamW with a lossy compressor (``OneBit``, ``Ternary``, top-k, random-k): a gradient
  derived from the decoded moment carries the compression error divided by ``1 - beta1``, and
  a second moment built from it steps too short. Each rank instead updates its own moments
  with its own gradient and sends its normalised step ``m / (sqrt(v') + eps)`` (bias
  corrected); every rank applies the average. ``v' = m^2 + (v - m^2) / n`` on ``n`` ranks: a
  rank's second moment holds the noise of a batch ``n`` times smaller than the one Adam
  normalises by, which made the averaged steps too short, and its variance part is scaled
  back to the full batch's (the hooks pass ``n = 1`` for random-k, which measured better without
  it). The moments differ between ranks; the parameters do not.

Parameters in buckets that go uncompressed (warm-up iterations, small buckets) take the
ordinary torch update from the averaged gradient. The update does not depend on the
learning rate, so schedulers work unchanged. Things that rewrite gradients between
``backward()`` and ``step()`` (``clip_grad_norm_``, ``GradScaler``) see the averaged
direction, not a gradient: clip with ``CompressionState(clip_norm=...)`` instead.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .compress import all_finite

__all__ = ["SGD", "Adam", "AdamW", "DirectionOptimizer"]


class DirectionOptimizer:
    """Mixin for a torch optimizer: computes a rank's update direction, then applies the average.

    The hook calls ``local_directions`` while backward runs (one bucket at a time) and
    ``step()`` applies whatever averaged directions arrived; every other parameter takes the
    base class's update.
    """

    def _direction_init(self) -> None:
        self._group_of: dict[torch.Tensor, dict[str, Any]] = {}
        # parameters whose .grad holds an averaged direction for the next step(), and whether
        # it was averaged exactly (local_directions' ``exact``)
        self._pending: dict[torch.Tensor, bool] = {}

    def _group(self, param: torch.Tensor) -> dict[str, Any]:
        group = self._group_of.get(param)
        if group is None:
            self._group_of = {p: g for g in self.param_groups for p in g["params"]}
            group = self._group_of.get(param)
            if group is None:
                raise ValueError("a DDP bucket holds a parameter that this optimizer does not optimize")
        return group

    @torch.no_grad()
    def local_directions(self, params: list[torch.Tensor], grads: list[torch.Tensor], ranks: int = 1,
                         exact: bool = True) -> None:
        """Overwrites each of ``grads`` (this rank's gradients of ``params``) with this rank's
        update direction; ``step()`` applies the average that the hook writes there.

        ``ranks``: how many ranks average. ``exact``: the average arrives up to rounding (an
        FP16 or BF16 compressor), not with a lossy compressor's error (Adam chooses what to
        send by it; SGD sends its momentum either way)."""
        if ranks < 1:
            raise ValueError(f"ranks must be at least 1, got {ranks}")
        for param, grad in zip(params, grads):
            self._direction(param, grad, self._group(param), ranks, exact)
            self._pending[param] = exact

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        pending, self._pending = self._pending, {}
        if not pending:
            return super().step(closure)
        # The base class skips parameters without a gradient: hide the averaged directions
        # from it, let it update the rest, then apply them.
        hidden = {p: p.grad for p in pending}
        for p in hidden:
            p.grad = None
        try:
            loss = super().step(closure)
        finally:
            for p, g in hidden.items():
                p.grad = g
        for param, exact in pending.items():
            if param.grad is not None:
                self._apply(param, param.grad, self._group(param), exact)
        return loss

    def _direction(self, param: torch.Tensor, grad: torch.Tensor, group: dict[str, Any], ranks: int,
                   exact: bool) -> None:
        raise NotImplementedError

    def _apply(self, param: torch.Tensor, direction: torch.Tensor, group: dict[str, Any], exact: bool) -> None:
        raise NotImplementedError


def _reject(group: dict[str, Any], name: str, options: tuple[str, ...]) -> None:
    for option in options:
        if group.get(option):
            raise ValueError(f"ddlcomm.optim.{name} does not support {option}=True with a compressed hook")


def _lr(group: dict[str, Any]) -> float:
    lr = group["lr"]
    return float(lr.item()) if isinstance(lr, torch.Tensor) else float(lr)


class SGD(DirectionOptimizer, torch.optim.SGD):
    """``torch.optim.SGD`` whose momentum a compressed hook averages (see the module docs).

    With ``momentum`` > 0 the hook compresses each rank's new momentum buffer; the average
    becomes the buffer on every rank. ``nesterov`` then steps by the implied averaged
    gradient plus ``momentum`` times the new buffer, as torch does.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._direction_init()

    def _direction(self, param, grad, group, ranks, exact):
        _reject(group, "SGD", ("differentiable",))
        if group["maximize"]:
            grad.neg_()
        if group["weight_decay"]:
            grad.add_(param, alpha=group["weight_decay"])
        momentum = group["momentum"]
        buf = self.state[param].get("momentum_buffer") if momentum else None
        if buf is None:  # no momentum, or torch's first step: the buffer starts as the gradient
            return
        grad.mul_(1 - group["dampening"]).add_(buf, alpha=momentum)

    def _apply(self, param, direction, group, exact):
        momentum = group["momentum"]
        lr = _lr(group)
        if not momentum:
            param.add_(direction, alpha=-lr)
            return
        state = self.state[param]
        buf = state.get("momentum_buffer")
        if group["nesterov"] and buf is not None:
            # torch steps by g + momentum * new_buf; g is implied by the averaged buffer
            # (nesterov requires dampening 0).
            implied = direction - momentum * buf
            param.add_(implied.add_(direction, alpha=momentum), alpha=-lr)
        elif group["nesterov"]:
            param.add_(direction, alpha=-lr * (1 + momentum))
        else:
            param.add_(direction, alpha=-lr)
        if buf is None:
            state["momentum_buffer"] = direction.clone()
        else:
            buf.copy_(direction)


class _AdamDirections(DirectionOptimizer):
    """Adam and AdamW (``decoupled_weight_decay``): the averaged first moment with one derived
    second moment when the average is exact, the averaged normalised step otherwise (see the
    module docs; docs/choosing-a-compressor.md has what else was measured)."""

    def _moments(self, param: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
        state = self.state[param]
        if not state:  # as torch initialises it on a parameter's first step
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            if group["amsgrad"]:
                state["max_exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        return state

    def _direction(self, param, grad, group, ranks, exact):
        _reject(group, type(self).__name__, ("capturable", "differentiable"))
        beta1, beta2 = (float(b) for b in group["betas"])
        state = self._moments(param, group)
        if group["maximize"]:
            grad.neg_()
        if group["weight_decay"] and not group["decoupled_weight_decay"]:
            grad.add_(param, alpha=group["weight_decay"])
        if exact:
            # lerp(m, g, 1 - beta1), m the same on every rank; the moments change in _apply. A
            # non-finite gradient stays non-finite (GradScaler skips the step).
            exp_avg = state["exp_avg"]
            grad.sub_(exp_avg).mul_(1 - beta1).add_(exp_avg)
            return
        if not all_finite(grad):
            # Leave the moments alone; the non-finite gradient goes out as it is, so the average
            # is non-finite on every rank (GradScaler skips the step).
            return
        step = float(state["step"]) + 1
        state["exp_avg"].lerp_(grad, 1 - beta1)
        state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        second = state["exp_avg_sq"]
        if group["amsgrad"]:
            second = torch.maximum(state["max_exp_avg_sq"], second, out=state["max_exp_avg_sq"])
        first = torch.div(state["exp_avg"], 1 - beta1**step, out=grad)
        # The variance part of this rank's second moment is that of a batch `ranks` times
        # smaller than the average's: scale it back (with one rank, Adam's own).
        squared = first * first
        denom = (second / (1 - beta2**step)).sub_(squared).clamp_(min=0.0).div_(ranks).add_(squared)
        first.div_(denom.sqrt_().add_(group["eps"]))

    def _apply(self, param, direction, group, exact):
        state = self.state[param]
        state["step"] += 1
        lr = _lr(group)
        if group["weight_decay"] and group["decoupled_weight_decay"]:
            param.mul_(1 - lr * group["weight_decay"])
        if not exact:
            param.add_(direction, alpha=-lr)
            return
        beta1, beta2 = (float(b) for b in group["betas"])
        step = float(state["step"])
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        # The average gradient, (m_new - beta1 * m) / (1 - beta1), times (1 - beta1), in exp_avg.
        exp_avg.mul_(-beta1).add_(direction)
        exp_avg_sq.mul_(beta2).addcmul_(exp_avg, exp_avg, value=(1 - beta2) / (1 - beta1) ** 2)
        exp_avg.copy_(direction)
        second = exp_avg_sq
        if group["amsgrad"]:
            second = torch.maximum(state["max_exp_avg_sq"], second, out=state["max_exp_avg_sq"])
        denom = (second.sqrt() / math.sqrt(1 - beta2**step)).add_(group["eps"])
        param.addcdiv_(exp_avg, denom, value=-lr / (1 - beta1**step))


class Adam(_AdamDirections, torch.optim.Adam):
    """``torch.optim.Adam`` whose moment or normalised step a compressed hook averages (see the module docs)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._direction_init()


class AdamW(_AdamDirections, torch.optim.AdamW):
    """``torch.optim.AdamW`` whose moment or normalised step a compressed hook averages (see the module docs)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._direction_init()
