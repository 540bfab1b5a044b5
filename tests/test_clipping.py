"""CompressionState(max_grad_norm=): clip_grad_norm_'s clipping of the average gradient where
the hook averages update directions (ddlcomm.clipping; the scenarios are tests/workers/clipping.py)."""

from __future__ import annotations

import pytest
import torch

from ddlcomm import clipping, compressors, hooks, optim
from harness import assert_all_ok, launch
from workers import clipping as clipping_scenarios


def test_max_grad_norm_clips_the_average_gradient_by_a_sketched_norm() -> None:
    """tests/workers/clipping.py: max_grad_norm_clips_the_average_gradient, then
    sketch_estimates_the_norm (the estimate's error against the math), in one launch."""
    assert_all_ok(launch(clipping_scenarios.sketch_and_clip, 2, timeout=180))


def test_max_grad_norm_is_only_for_directions() -> None:
    """Where .grad holds the average gradient, clip_grad_norm_ is the way (after GradScaler.unscale_)."""
    opt = optim.AdamW(torch.nn.Linear(4, 4).parameters())
    for compressor, optimizer in ((compressors.FP16(), opt), (compressors.Ternary(), None)):
        with pytest.raises(ValueError, match="clip_grad_norm_"):
            hooks.CompressionState(compressor=compressor, optimizer=optimizer, max_grad_norm=1.0)
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="positive"):
            hooks.CompressionState(compressor=compressors.Ternary(), optimizer=opt, max_grad_norm=bad)


@pytest.mark.parametrize("norm", [0.0, 0.5, 1.0, 4.0])
def test_coefficient_is_clip_grad_norm_s_factor(norm: float) -> None:
    """clipping.coefficient scales as torch.nn.utils.clip_grad_norm_(max_norm=1) does: a gradient
    whose norm is below the cap is left as it is (never scaled up), one at or above it is scaled by
    max_norm / (norm + EPS). The reference is clip_grad_norm_ itself, on a gradient of that norm."""
    grad = torch.full((4,), norm / 2)  # norm 2 * norm / 2
    param = torch.nn.Parameter(torch.zeros(4))
    param.grad = grad.clone()
    torch.nn.utils.clip_grad_norm_([param], 1.0)
    scale = clipping.coefficient(torch.linalg.vector_norm(grad), 1.0)
    if norm < 1.0:
        assert float(scale) == 1.0
    else:
        assert float(scale) == pytest.approx(1.0 / (norm + clipping.EPS))
    torch.testing.assert_close(grad * scale, param.grad, rtol=0, atol=0)
