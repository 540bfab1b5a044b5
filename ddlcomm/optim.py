"""Optimizers whose update direction a compressed DDP hook averages, for accuracy under compression.

Error feedback makes a compressed gradient correct on average over steps, not at each step.
Fed into momentum SGD or Adam, the delayed part comes back amplified: momentum repeats it for
about ``1 / (1 - momentum)`` steps, and Adam divides it by a second moment that never saw it.
At the learning rates people use, 1-bit compressed gradients then train badly or diverge
(docs/choosing-a-compressor.md has the measurements).

These optimizers are drop-in subclasses of ``torch.optim.SGD``, ``Adam`` and ``AdamW`` (same
arguments, same ``state_dict``; ``convert`` makes one of torch's, built by a framework, the
subclass in place), with one addition: a compressed hook given the optimizer
(``CompressionState(..., optimizer=opt)``) asks each rank for the direction its optimizer
would step in, given its own gradient, and averages *that* through the compressor with
error feedback. ``step()`` then applies the averaged direction on every rank. What is
compressed is what the parameters will move by, which is smooth (momentum, Adam's first
moment) or evenly scaled (Adam's normalised step), so the compression error is not amplified
afterwards:

* SGD: the direction is the new momentum ``momentum * buf + (1 - dampening) * (g + wd * p)``.
  The averaged direction becomes every rank's momentum buffer, which stays identical on all
  ranks (1-bit Adam's and Zheng et al. 2019's compressed momentum). Through top-k an element
  reaches the average only when it is sent, and a buffer rebuilt from the average would hold
  it only then: each round of momentum would wait for another send. There each rank keeps its
  own buffer, updated as torch does with its own gradient, and sends its step (``buf``, or
  ``g + momentum * buf`` with nesterov), as Deep Gradient Compression's momentum correction
  does (the hooks say so with ``sparse=True``).
* Adam / AdamW: each rank updates its own moments with its own gradient and sends its
  normalised step ``m / (sqrt(v') + eps)`` (bias corrected); every rank applies the average.
  ``v' = m^2 + (v - m^2) / n`` on ``n`` ranks: a rank's second moment holds the noise of a
  batch ``n`` times smaller than the one Adam normalises by, which made the averaged steps
  too short, and its variance part is scaled back to the full batch's (the hooks pass
  ``n = 1`` for random-k, which measured better without it). The moments differ between
  ranks; the parameters do not. ``ddlcomm.moments`` holds this rule, which ``ddlcomm.fsdp``
  applies too.

Compressors that only round (``FP16``, ``BF16``) need none of this: through them the hooks
average the gradient itself and the optimizer takes torch's step, so Adam is Adam on the
average gradient and ``clip_grad_norm_`` and ``GradScaler`` work as they do without a hook.

Parameters in buckets that go uncompressed (warm-up iterations, small buckets) take the
ordinary torch update from the averaged gradient. The update does not depend on the
learning rate, so schedulers work unchanged. After a lossy compressed step ``.grad`` holds
the averaged direction, not a gradient: ``clip_grad_norm_`` or ``GradScaler.unscale_``
between ``backward()`` and ``step()`` would act on the wrong quantity, and ``step()`` raises
if anything changed it; the hook's ``max_grad_norm=`` clips as ``clip_grad_norm_`` would
(``ddlcomm.clipping``).
"""

from __future__ import annotations

import inspect
import logging
from typing import Any, Optional

import torch

from .compressors import BF16, FP16, Compressor, OneBit, RandomK, TopK, all_finite, device_finite
from .moments import normalised_step, update_first, update_second

__all__ = ["SGD", "Adam", "AdamW", "DirectionOptimizer", "averages_directions", "convert", "for_compressor"]

_hook_logger = logging.getLogger("ddlcomm.hooks")  # what for_compressor says is about the hook


def averages_directions(optimizer: Optional[torch.optim.Optimizer], compressor: Optional[Compressor]) -> bool:
    """Whether an average through ``compressor`` carries ``optimizer``'s update directions, not
    gradients: a ``DirectionOptimizer`` and a lossy compressor. FP16 and BF16 only round, so
    they always average the gradient (None: the caller decides per call, as the adaptive hook)."""
    return isinstance(optimizer, DirectionOptimizer) and not isinstance(compressor, (FP16, BF16))


class DirectionOptimizer:
    """Mixin for a torch optimizer: computes a rank's update direction, then applies the average.

    The hook calls ``local_directions`` while backward runs (one bucket at a time) and
    ``averaged`` when a bucket's average arrives; ``step()`` applies the averaged directions
    and every other parameter takes the base class's update.
    """

    # Leading elements of each averaged direction kept to notice a rewrite before step():
    # clip_grad_norm_ and GradScaler.unscale_ scale every element.
    _SAMPLE = 8

    def _direction_init(self) -> None:
        self._group_of: dict[torch.Tensor, dict[str, Any]] = {}
        # parameters whose .grad holds an averaged direction for the next step(), with the
        # direction's leading elements as it arrived (None until it has)
        self._pending: dict[torch.Tensor, Optional[torch.Tensor]] = {}
        self._sparse: set[torch.Tensor] = set()  # parameters last sent through a sparse compressor

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
                         sparse: bool = False) -> None:
        """Overwrites each of ``grads`` (this rank's gradients of ``params``) with this rank's
        update direction; ``step()`` applies the average that the hook writes there.

        ``ranks``: how many ranks average (Adam scales its second moment's variance by it).
        ``sparse``: the compressor sends each entry only now and then (top-k, random-k), so
        SGD keeps its momentum on each rank (see the module docs)."""
        if ranks < 1:
            raise ValueError(f"ranks must be at least 1, got {ranks}")
        for param, grad in zip(params, grads):
            self._direction(param, grad, self._group(param), ranks, sparse)
            self._pending[param] = None
            if sparse:
                self._sparse.add(param)
            else:
                self._sparse.discard(param)

    def directions_for(self, params: list[torch.Tensor], grads: list[torch.Tensor], compressor: Optional[Compressor],
                       ranks: int) -> None:
        """``local_directions`` for an average of ``ranks`` ranks through ``compressor``.

        Random-k keeps each rank's own second moment (ranks=1): it trained worse with the
        correction for the ranks' smaller batches. Top-k keeps SGD's momentum on each rank (its
        largest entries wait for their turn); random-k, whose entries all wait about as long,
        trained better with the shared one (docs/choosing-a-compressor.md)."""
        samples = compressor is not None and compressor.samples_randomly
        sparse = compressor is not None and compressor.is_sparse
        self.local_directions(params, grads, ranks=1 if samples else ranks, sparse=sparse and not samples)

    @torch.no_grad()
    def averaged(self, params: list[torch.Tensor], directions: list[torch.Tensor]) -> None:
        """The hook's average of ``params``' directions has arrived: ``step()`` checks that
        nothing rewrote it in ``.grad`` before it is applied."""
        # Copied together: one operation a bucket (a kernel launch on a GPU), not one a parameter.
        heads = [direction.reshape(-1)[: self._SAMPLE] for direction in directions]
        samples = torch.cat(heads).split([head.numel() for head in heads]) if heads else ()
        for param, sample in zip(params, samples):
            self._pending[param] = sample

    def _check_unchanged(self, pending: dict[torch.Tensor, Optional[torch.Tensor]]) -> None:
        groups: dict[tuple[torch.device, torch.dtype], list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for p, sample in pending.items():
            if sample is not None and p.grad is not None:
                now = p.grad.reshape(-1)[: self._SAMPLE]
                groups.setdefault((sample.device, sample.dtype), []).append((now, sample))
        # One comparison per device and dtype, each parameter's only where it fails: on a GPU
        # reading an answer waits for the device, once a step rather than once a parameter.
        changed = 0
        for pairs in groups.values():
            if not torch.equal(torch.cat([now for now, _ in pairs]), torch.cat([sample for _, sample in pairs])):
                changed += sum(1 for now, sample in pairs if not torch.equal(now, sample))
        if changed:
            name = f"ddlcomm.optim.{type(self).__name__}"
            raise RuntimeError(
                f"{name}: .grad of {changed} parameter(s) changed between backward() and step(). With a lossy "
                f"compressor and optimizer=, .grad holds the averaged update direction, not a gradient: "
                f"torch.nn.utils.clip_grad_norm_ and GradScaler would scale the wrong quantity. To clip, pass "
                f"max_grad_norm= to the hook's CompressionState instead (it clips the average gradient as "
                f"clip_grad_norm_ does); GradScaler works with FP16() or BF16() (which average the gradient "
                f"itself) or a hook without optimizer=; for mixed precision, torch.autocast(dtype=torch.bfloat16) "
                f"needs no GradScaler")

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        # A closure (Lightning, L-BFGS-style loops) runs backward, and with it the hook that
        # leaves the averaged directions: first, as torch's optimizers run it.
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        pending, self._pending = self._pending, {}
        if not pending:
            self._torch_step()
            return loss
        self._check_unchanged(pending)
        # The base class skips parameters without a gradient: hide the averaged directions
        # from it, let it update the rest, then apply them.
        hidden = {p: p.grad for p in pending}
        for p in hidden:
            p.grad = None
        try:
            self._torch_step()
        finally:
            for p, g in hidden.items():
                p.grad = g
        for param in pending:
            if param.grad is not None:
                self._apply(param, param.grad, self._group(param))
        return loss

    def _torch_step(self) -> None:
        """The torch class's ``step()`` without the wrapper torch gives each optimizer class's
        ``step`` (its step hooks and profiler span): this class's own ``step`` is wrapped too,
        and the hooks already ran once for this step."""
        step = super().step.__func__
        if getattr(step, "hooked", False):
            step = step.__wrapped__
        step(self)

    def _direction(self, param: torch.Tensor, grad: torch.Tensor, group: dict[str, Any], ranks: int,
                   sparse: bool) -> None:
        raise NotImplementedError

    def _apply(self, param: torch.Tensor, direction: torch.Tensor, group: dict[str, Any]) -> None:
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
    gradient plus ``momentum`` times the new buffer, as torch does. Through a sparse
    compressor each rank keeps its own buffer and the hook averages its step.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._direction_init()

    def _direction(self, param, grad, group, ranks, sparse):
        _reject(group, "SGD", ("differentiable",))
        if group["maximize"]:
            grad.neg_()
        if group["weight_decay"]:
            grad.add_(param, alpha=group["weight_decay"])
        momentum = group["momentum"]
        buf = self.state[param].get("momentum_buffer") if momentum else None
        # On a GPU, past the buffer's first step, whether the gradient is finite is decided on
        # the device (as Adam's): reading it on the host would wait for the GPU once per parameter.
        finite = device_finite(grad) if sparse and momentum and buf is not None else None
        if finite is not None:
            new = buf.mul(momentum).add_(grad, alpha=1 - group["dampening"])
            torch.where(finite, grad.add(new, alpha=momentum) if group["nesterov"] else new, grad, out=grad)
            torch.where(finite, new, buf, out=buf)
            return
        if sparse and momentum and all_finite(grad):
            # torch's step on this rank's gradient, the momentum kept here: a buffer rebuilt from
            # the sparse average would hold each element only once it was sent.
            if buf is None:
                buf = self.state[param]["momentum_buffer"] = grad.clone()
            else:
                buf.mul_(momentum).add_(grad, alpha=1 - group["dampening"])
            if group["nesterov"]:
                grad.add_(buf, alpha=momentum)
            else:
                grad.copy_(buf)
            return
        if buf is None or sparse:  # no momentum, torch's first step, or a non-finite gradient
            return
        grad.mul_(1 - group["dampening"]).add_(buf, alpha=momentum)

    def _apply(self, param, direction, group):
        momentum = group["momentum"]
        lr = _lr(group)
        if not momentum or param in self._sparse:
            param.add_(direction, alpha=-lr)
            return
        state = self.state[param]
        buf = state.get("momentum_buffer")
        if group["nesterov"] and buf is not None:
            # torch steps by g + momentum * new_buf; g = new_buf - momentum * old_buf is implied
            # by the averaged buffer (nesterov requires dampening 0). In place: a temporary of
            # a large parameter's size costs more than the step on a CPU (page faults).
            param.add_(direction, alpha=-lr * (1 + momentum)).add_(buf, alpha=lr * momentum)
        elif group["nesterov"]:
            param.add_(direction, alpha=-lr * (1 + momentum))
        else:
            param.add_(direction, alpha=-lr)
        if buf is None:
            state["momentum_buffer"] = direction.clone()
        else:
            buf.copy_(direction)


class _AdamDirections(DirectionOptimizer):
    """Adam and AdamW (``decoupled_weight_decay``): the averaged normalised step (see the module
    docs; docs/choosing-a-compressor.md has what else was measured)."""

    def _direction(self, param, grad, group, ranks, sparse):
        _reject(group, type(self).__name__, ("capturable", "differentiable"))
        beta1, beta2 = (float(b) for b in group["betas"])
        state = self.state[param]
        if not state:  # as torch initialises it on a parameter's first step
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            if group["amsgrad"]:
                state["max_exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        if group["maximize"]:
            grad.neg_()
        if group["weight_decay"] and not group["decoupled_weight_decay"]:
            grad.add_(param, alpha=group["weight_decay"])
        # A non-finite gradient leaves the moments alone and goes out as it is, so the average is
        # non-finite on every rank (GradScaler skips the step). On a GPU that is decided on the
        # device: reading it on the host would wait for the GPU once per parameter.
        finite = device_finite(grad)
        if finite is None and not all_finite(grad):
            return
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        if finite is None:
            update_first(exp_avg, grad, beta1)
            update_second(exp_avg_sq, grad, beta2)
        else:
            torch.where(finite, update_first(exp_avg.clone(), grad, beta1), exp_avg, out=exp_avg)
            torch.where(finite, update_second(exp_avg_sq.clone(), grad, beta2), exp_avg_sq, out=exp_avg_sq)
        second = exp_avg_sq
        if group["amsgrad"]:
            second = torch.maximum(state["max_exp_avg_sq"], second, out=state["max_exp_avg_sq"])
        step = normalised_step(exp_avg, second, float(state["step"]) + 1, beta1, beta2, group["eps"], ranks,
                               out=grad if finite is None else None)
        if finite is not None:
            torch.where(finite, step, grad, out=grad)

    def _apply(self, param, direction, group):
        self.state[param]["step"] += 1
        lr = _lr(group)
        if group["weight_decay"] and group["decoupled_weight_decay"]:
            param.mul_(1 - lr * group["weight_decay"])
        param.add_(direction, alpha=-lr)


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


def convert(optimizer: torch.optim.Optimizer) -> DirectionOptimizer:
    """``optimizer`` as the ``ddlcomm.optim`` optimizer a compressed hook averages the update
    directions of, for an optimizer built by someone else (a trainer, a framework).

    A ``torch.optim.SGD``, ``Adam`` or ``AdamW`` (exactly those classes) becomes the subclass of
    the same name here, in place: the object, its parameter groups, state and hyper-parameters
    stay what they are, so a learning-rate scheduler, a framework's wrapper or anything else
    that holds it keeps working; only its ``step()`` now applies the averaged directions. A
    ``DirectionOptimizer`` is returned as it is; anything else raises ``TypeError``.
    """
    if isinstance(optimizer, DirectionOptimizer):
        return optimizer
    ours = _CONVERTIBLE.get(type(optimizer))
    if ours is None:
        raise TypeError(f"a compressed hook averages the update directions of ddlcomm.optim's SGD, Adam and AdamW "
                        f"(torch's own are converted in place); got {type(optimizer).__module__}."
                        f"{type(optimizer).__name__}")
    before = type(optimizer).step
    optimizer.__class__ = ours
    optimizer._direction_init()
    # As torch's __setstate__ does for an optimizer built without __init__: wrap the class's
    # step() for the step hooks, once per class.
    optimizer._patch_step_function()
    # An LR scheduler made before this wrapped the instance's step() around the class's step
    # function it found then (torch's lr_scheduler, to check the call order): point that
    # wrapper at this class's step, or say why the optimizer cannot be converted.
    wrapper = optimizer.__dict__.get("step")
    if wrapper is not None:
        cells = [c for c in getattr(wrapper, "__closure__", None) or () if c.cell_contents is before]
        if not cells:
            optimizer.__class__ = _TORCH[ours]
            raise TypeError(f"ddlcomm.optim.convert: this {_TORCH[ours].__name__}'s step() was replaced by "
                            f"{wrapper!r}, which cannot be pointed at ddlcomm.optim.{ours.__name__}.step: build "
                            f"ddlcomm.optim.{ours.__name__} instead, or convert before wrapping step()")
        for cell in cells:
            cell.cell_contents = ours.step
    return optimizer


def for_compressor(optimizer: torch.optim.Optimizer, compressor: Compressor) -> DirectionOptimizer:
    """``convert(optimizer)`` for a hook through ``compressor``, saying so once: the conversion
    (at INFO level), and where the pair lost accuracy on the recipes of docs/results/recipes.md
    and compressors.md (1-bit or top-k with Adam, top-k with SGD on the transformer, random-k
    with any optimizer, where ternary kept it)."""
    if not isinstance(optimizer, DirectionOptimizer):
        name = f"{type(optimizer).__module__}.{type(optimizer).__name__}"
        optimizer = convert(optimizer)
        _hook_logger.info("ddlcomm hook: %s is now ddlcomm.optim.%s (the same object): its step() applies the "
                          "averaged update directions", name, type(optimizer).__name__)
    if isinstance(compressor, RandomK) or (isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW))
                                           and isinstance(compressor, (OneBit, TopK))):
        _hook_logger.warning("ddlcomm hook: %r with %s lost accuracy on recipes where Ternary() kept it "
                             "(docs/results/recipes.md); consider Ternary()", compressor, type(optimizer).__name__)
    elif isinstance(compressor, TopK):
        _hook_logger.warning("ddlcomm hook: %r with %s kept accuracy on the classifiers but lost it on the transformer "
                             "language model, where Ternary() kept it (docs/results/compressors.md); consider "
                             "Ternary()", compressor, type(optimizer).__name__)
    return optimizer


_CONVERTIBLE: dict[type, type] = {torch.optim.SGD: SGD, torch.optim.Adam: Adam, torch.optim.AdamW: AdamW}
_TORCH = {ours: theirs for theirs, ours in _CONVERTIBLE.items()}

# help() and IDEs show torch's arguments rather than (*args, **kwargs).
for _ours, _torch in ((SGD, torch.optim.SGD), (Adam, torch.optim.Adam), (AdamW, torch.optim.AdamW)):
    _ours.__init__.__signature__ = inspect.signature(_torch.__init__)  # type: ignore[attr-defined]
