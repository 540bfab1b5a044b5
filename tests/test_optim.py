"""ddlcomm.optim in one process: the direction it hands a hook, applied unchanged (what an exact
average over one rank gives), must step like the torch optimizer it subclasses; without a
hook it is that torch optimizer. On 2 ranks, the fp16 and bf16 hooks are the torch optimizer on
the average gradient, clipping and GradScaler included; lossy ones refuse a rewritten direction."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

from ddlcomm import compressors, hooks, optim
from harness import assert_all_ok, launch
from workers import closure, compression

CASES = [
    ("SGD", dict(lr=0.1, momentum=0.9)),
    ("SGD", dict(lr=0.1, momentum=0.9, weight_decay=0.01, dampening=0.1)),
    ("SGD", dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01)),
    ("SGD", dict(lr=0.1)),
    ("SGD", dict(lr=0.1, momentum=0.5, maximize=True)),
    ("Adam", dict(lr=1e-2)),
    ("Adam", dict(lr=1e-2, weight_decay=0.1, amsgrad=True)),
    ("AdamW", dict(lr=1e-2, weight_decay=0.1)),
    ("AdamW", dict(lr=1e-2, betas=(0.8, 0.99), amsgrad=True, maximize=True)),
]


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(5, 3, generator=g)), torch.nn.Parameter(torch.randn(7, generator=g))]


def _grads(step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(5, 3, generator=g), torch.randn(7, generator=g)]


def _pair(name: str, options: dict) -> tuple:
    """The same parameters under ddlcomm.optim.<name> and torch.optim.<name>."""
    ours_p, ref_p = _params(), _params()
    return ours_p, ref_p, getattr(optim, name)(ours_p, **options), getattr(torch.optim, name)(ref_p, **options)


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
@pytest.mark.parametrize("name,options", CASES)
def test_direction_steps_like_torch(name: str, options: dict, sparse: bool) -> None:
    """On one rank the average is the rank's own direction: both of SGD's designs (the shared
    momentum, each rank's own for sparse compressors) and Adam's are torch's step."""
    ours_p, ref_p, ours, ref = _pair(name, options)
    for step in range(6):
        grads = _grads(step)
        for p, q, g in zip(ours_p, ref_p, grads):
            p.grad, q.grad = g.clone(), g.clone()
        if step >= 2:  # the first steps as a warm-up would run them: the plain torch update
            ours.local_directions(ours_p, [p.grad for p in ours_p], sparse=sparse)
        ours.step()
        ref.step()
        for p, q in zip(ours_p, ref_p):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    for key in ("momentum_buffer", "exp_avg_sq", "step"):
        if key in ref.state[ref_p[0]] and ref.state[ref_p[0]][key] is not None:
            torch.testing.assert_close(ours.state[ours_p[0]][key], ref.state[ref_p[0]][key], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name,options", CASES)
def test_without_a_hook_it_is_the_torch_optimizer(name: str, options: dict) -> None:
    ours_p, ref_p, ours, ref = _pair(name, options)
    for step in range(4):
        for p, q, g in zip(ours_p, ref_p, _grads(step)):
            p.grad, q.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
    assert all(torch.equal(p, q) for p, q in zip(ours_p, ref_p))
    # The same state_dict format, both ways.
    again = getattr(optim, name)(_params(), **options)
    again.load_state_dict(copy.deepcopy(ref.state_dict()))
    ref.load_state_dict(copy.deepcopy(ours.state_dict()))


def test_non_finite_gradient_leaves_adam_moments_alone() -> None:
    params = _params()
    opt = optim.AdamW(params, lr=1e-2)
    for p, g in zip(params, _grads(0)):
        p.grad = g
    opt.step()
    before = {k: v.clone() for k, v in opt.state[params[0]].items()}
    grads = _grads(1)
    grads[0][1, 1] = float("inf")
    opt.local_directions(params, grads, ranks=2)
    assert not torch.isfinite(grads[0]).all()
    assert all(torch.equal(opt.state[params[0]][k], v) for k, v in before.items())


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


@pytest.mark.parametrize("name,options", [case for case in CASES if case[0] != "SGD" or case[1].get("momentum")])
def test_directions_masked_on_the_device_are_the_hosts_bits(monkeypatch: pytest.MonkeyPatch, name: str,
                                                            options: dict) -> None:
    """On a GPU, Adam's directions, and SGD's with a sparse compressor (each rank's own momentum),
    mask a non-finite gradient on the device (device_finite) instead of reading on the host
    whether it is finite. Forced here on CPU tensors: the same directions and moments, bit for
    bit, over steps with finite gradients and one with a NaN."""
    runs = []
    for on_device in (False, True):
        if on_device:
            monkeypatch.setattr(optim, "device_finite", lambda t: torch.isfinite(t).all())
        params = _params()
        opt = getattr(optim, name)(params, **options)
        directions = []
        for step in range(4):
            grads = _grads(step)
            if step == 2:
                grads[0][1, 1] = float("nan")
            opt.local_directions(params, grads, ranks=2, sparse=name == "SGD")
            directions += grads
        runs.append((directions, [v for p in params for v in opt.state[p].values() if v.dim()]))
    for ours, theirs in zip(*runs):
        assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(ours, theirs))
    assert not torch.isfinite(runs[1][0][4]).all()  # step 2's first direction went out non-finite


@pytest.mark.parametrize("rewrite", ["clip_grad_norm_", "unscale"])
def test_step_refuses_a_rewritten_direction(rewrite: str) -> None:
    """clip_grad_norm_ or GradScaler.unscale_ between the hook's average and step() would scale
    a direction as if it were a gradient: step() names them instead of stepping."""
    params = _params()
    opt = optim.AdamW(params, lr=1e-2)
    grads = _grads(0)
    opt.local_directions(params, grads, ranks=2)
    opt.averaged(params, grads)
    for p, g in zip(params, grads):
        p.grad = g.clone()
    before = [p.detach().clone() for p in params]
    if rewrite == "clip_grad_norm_":
        torch.nn.utils.clip_grad_norm_(params, 1.0)
    else:
        for p in params:
            p.grad.mul_(1 / 65536.0)
    with pytest.raises(RuntimeError, match="clip_grad_norm_ and GradScaler.*FP16"):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(params, before)), "a refused step moved the parameters"
    # Untouched, the same direction steps.
    opt.local_directions(params, _grads(1), ranks=2)
    opt.averaged(params, [p.grad for p in params])
    opt.step()
    assert not all(torch.equal(p, b) for p, b in zip(params, before))


def test_fp16_and_bf16_are_torch_on_the_average_gradient_with_clipping_and_grad_scaler() -> None:
    """2 ranks, 20 steps of a small model, three recipes (AdamW; AdamW with clip_grad_norm_;
    nesterov SGD with GradScaler and clip_grad_norm_): the fp16 and bf16 hooks with
    optimizer=ddlcomm.optim.* end where plain DDP with the torch optimizer does, within the
    compressor's rounding (tests/workers/compression.py derives the tolerance), clip_grad_norm_
    sees plain's norms, and the replicas are the same bits."""
    assert_all_ok(launch(compression.matches_plain, 2, timeout=180))


def test_clipping_or_grad_scaler_on_averaged_directions_is_refused() -> None:
    assert_all_ok(launch(compression.misuse_is_refused, 2, timeout=120))


def test_step_with_a_closure_applies_the_averaged_directions() -> None:
    """2 ranks, SGD with momentum and AdamW through 1-bit and top-k hooks, compressed from the
    third step: ``opt.step(closure)`` (backward inside step(), as Lightning and L-BFGS-style
    loops call it) trains bit for bit as ``closure(); opt.step()`` and returns the closure's
    loss (tests/workers/closure.py)."""
    assert_all_ok(launch(closure.closure_steps, 2, timeout=180))


def test_hook_state_takes_ddlcomm_and_torch_optimizers_only() -> None:
    params = _params()
    with pytest.raises(TypeError, match="ddlcomm.optim's SGD, Adam and AdamW"):
        hooks.CompressionState(optimizer=torch.optim.RMSprop(params, lr=0.1))

    class Custom(torch.optim.SGD):  # a subclass may step otherwise: not converted
        pass

    with pytest.raises(TypeError, match="Custom"):
        hooks.CompressionState(optimizer=Custom(params, lr=0.1))
    with pytest.raises(ValueError, match="momentum"):
        hooks.CompressionState(optimizer=optim.SGD(params, lr=0.1), momentum=0.9)
    with pytest.raises(ValueError, match="differentiable"):
        opt = optim.SGD(params, lr=0.1, momentum=0.9, differentiable=True)
        opt.local_directions(params, _grads(0))
    stranger = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match="does not optimize"):
        optim.SGD(params, lr=0.1).local_directions([stranger], [torch.zeros(3)])


class _Bucket:
    """The part of dist.GradBucket the hook reads before it communicates."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self._params = params
        self._buffer = torch.cat([p.detach().reshape(-1) for p in params])

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def parameters(self) -> list[torch.nn.Parameter]:
        return self._params

    def index(self) -> int:
        return 0


def test_loaded_state_refuses_to_run_without_its_optimizer() -> None:
    """A pickled state drops its optimizer (the optimizer is saved by its owner); training on
    without setting it again would compress gradients into residuals of directions."""
    params = _params()
    state = hooks.CompressionState(optimizer=optim.SGD(params, lr=0.1, momentum=0.9), min_compression_bytes=0)
    state.iter = state.start_compress_iter
    loaded = pickle.loads(pickle.dumps(state))
    assert loaded.optimizer is None
    with pytest.raises(RuntimeError, match="pickled with optimizer= and loaded without"):
        hooks.compressed_hook(loaded, _Bucket(params))
    again = pickle.loads(pickle.dumps(loaded))  # still refuses after another round trip
    with pytest.raises(RuntimeError, match="loaded without"):
        hooks.compressed_hook(again, _Bucket(params))
    # A state made without an optimizer is not affected.
    plain = pickle.loads(pickle.dumps(hooks.CompressionState()))
    assert not plain.checkpoint.detached


def test_signatures_are_torchs() -> None:
    """help() and IDEs show the torch optimizer's arguments, not (*args, **kwargs)."""
    import inspect

    for ours, theirs in ((optim.SGD, torch.optim.SGD), (optim.Adam, torch.optim.Adam), (optim.AdamW, torch.optim.AdamW)):
        assert inspect.signature(ours) == inspect.signature(theirs), ours
    assert "betas" in inspect.signature(optim.AdamW).parameters


@pytest.mark.parametrize("name", ["Adam", "AdamW"])
def test_adam_direction_scales_the_variance_by_the_ranks(name: str) -> None:
    """The direction Adam and AdamW hand a hook averaging over 4 ranks, over 3 steps, against
    Adam's moments written out here: m and v as torch updates them, bias corrected, and the step
    m / (sqrt(v') + eps) with v' = m^2 + max(v - m^2, 0) / ranks. At step 1 v = m^2, so the
    ranks change nothing there: steps 2 and 3 tell whether they are passed on."""
    beta1, beta2, eps, ranks = 0.8, 0.95, 1e-8, 4
    params = _params()
    opt = getattr(optim, name)(params, lr=1e-2, betas=(beta1, beta2), eps=eps)
    first = [torch.zeros_like(p) for p in params]
    second = [torch.zeros_like(p) for p in params]
    for step in (1, 2, 3):
        grads = _grads(step)
        directions = [g.clone() for g in grads]
        opt.local_directions(params, directions, ranks=ranks)
        for i, (grad, direction) in enumerate(zip(grads, directions)):
            first[i] = beta1 * first[i] + (1 - beta1) * grad
            second[i] = beta2 * second[i] + (1 - beta2) * grad * grad
            m = first[i] / (1 - beta1**step)
            v = second[i] / (1 - beta2**step)
            expected = m / ((m * m + (v - m * m).clamp(min=0) / ranks).sqrt() + eps)
            torch.testing.assert_close(direction, expected, msg=lambda text: f"step {step}: {text}")
        opt.averaged(params, directions)  # one rank's average is its own direction
        for param, direction in zip(params, directions):
            param.grad = direction
        opt.step()


def test_adams_normalised_step_scales_the_variance_and_is_bounded() -> None:
    """ddlcomm.moments, the rule of ddlcomm.optim's Adam and of ddlcomm.fsdp's adam_betas=:
    m / sqrt(m^2 + (v - m^2) / ranks), so never more than 1 in size, even where v < m^2."""
    from ddlcomm.moments import normalised_step

    m = torch.tensor([0.3, -0.3, 0.5, 0.0, 2.0])
    v = torch.tensor([0.25, 0.09, 0.0, 0.0, 16.0])
    late = 10_000  # the bias corrections are 1
    one = normalised_step(m, v, late, 0.9, 0.99, 0.0, ranks=1)
    torch.testing.assert_close(one, torch.tensor([0.6, -1.0, 1.0, float("nan"), 0.5]), equal_nan=True)
    four = normalised_step(m, v, late, 0.9, 0.99, 1e-8, ranks=4)
    expected = m / ((m**2 + (v - m**2).clamp(min=0) / 4).sqrt() + 1e-8)
    torch.testing.assert_close(four, expected)
    assert float(four.abs().max()) <= 1.0 and float(four[0]) > float(one[0])
    # At step 1 the bias corrections divide m by 1 - beta1 and v by 1 - beta2.
    first = normalised_step(m * 0.1, v * 0.01, 1, 0.9, 0.99, 0.0, ranks=1)
    torch.testing.assert_close(first[:3], torch.tensor([0.3 / 0.5, -1.0, 1.0]))


@pytest.mark.parametrize("name", ["SGD", "Adam", "AdamW"])
def test_step_hooks_run_once_per_step(name: str) -> None:
    """torch wraps each optimizer class's step() to run the step hooks; ddlcomm.optim's step()
    calls torch's own, which is wrapped too once any torch optimizer of that class exists (a
    DiLoCo's outer SGD, say): the hooks must still run once a step, with and without an
    averaged direction to apply."""
    params = _params()
    getattr(torch.optim, name)(params, lr=0.1)  # wraps torch's class's step()
    opt = getattr(optim, name)(params, lr=0.1)
    calls = {"pre": 0, "post": 0}
    opt.register_step_pre_hook(lambda *_: calls.__setitem__("pre", calls["pre"] + 1))
    opt.register_step_post_hook(lambda *_: calls.__setitem__("post", calls["post"] + 1))
    for step in range(2):
        grads = _grads(step)
        if step:  # the second step applies averaged directions, as after a compressed backward
            opt.local_directions(params, grads, ranks=1)
            opt.averaged(params, grads)
        for param, grad in zip(params, grads):
            param.grad = grad
        opt.step()
        assert calls == {"pre": step + 1, "post": step + 1}, (step, calls)


@pytest.mark.parametrize("name", ["SGD", "Adam", "AdamW"])
def test_torch_optimizer_is_converted_in_place(name: str) -> None:
    """A framework builds torch's optimizer (and a scheduler on it) before or after the hook:
    CompressionState(optimizer=) or state.attach() makes it the ddlcomm.optim class in place,
    so whoever holds it keeps the same object, and it steps as the ddlcomm class built directly
    does: with and without averaged directions, bit for bit."""
    options = {"lr": 0.05, "weight_decay": 0.01} | ({"momentum": 0.9} if name == "SGD" else {})
    built, direct = _params(), _params()
    theirs = getattr(torch.optim, name)(built, **options)
    schedule = torch.optim.lr_scheduler.LambdaLR(theirs, lambda step: 0.9**step)
    state = hooks.CompressionState(compressor=compressors.Ternary())
    assert state.attach(theirs) is theirs and state.optimizer is theirs
    assert type(theirs) is getattr(optim, name) and isinstance(theirs, getattr(torch.optim, name))
    ours = getattr(optim, name)(direct, **options)
    ours_schedule = torch.optim.lr_scheduler.LambdaLR(ours, lambda step: 0.9**step)
    for step in range(3):
        for opt, params in ((theirs, built), (ours, direct)):
            grads = _grads(step)
            if step:  # as after a compressed backward on one rank
                opt.local_directions(params, grads, ranks=1)
                opt.averaged(params, grads)
            for param, grad in zip(params, grads):
                param.grad = grad
            opt.step()
        schedule.step()
        ours_schedule.step()
        for a, b in zip(built, direct):
            assert torch.equal(a, b), f"step {step}"
    with pytest.raises(ValueError, match="attach the optimizer once"):
        state.attach(getattr(torch.optim, name)(_params(), lr=0.1))


def test_convert_refuses_a_step_it_cannot_redirect() -> None:
    """An instance whose step() someone replaced by a function that does not wrap the class's
    is left a torch optimizer, with a TypeError saying what to do."""
    opt = torch.optim.SGD(_params(), lr=0.1)
    opt.step = lambda closure=None: None  # type: ignore[method-assign]
    with pytest.raises(TypeError, match="build ddlcomm.optim.SGD instead"):
        optim.convert(opt)
    assert type(opt) is torch.optim.SGD
