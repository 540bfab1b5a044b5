"""CompressionState(max_grad_norm=): clip_grad_norm_'s clipping of the average gradient where
the hook averages update directions (ddlcomm.clipping; the scenarios are tests/workers/clipping.py)."""

from __future__ import annotations

import pytest
import torch

from ddlcomm import compressors, hooks, optim
from harness import assert_all_ok, launch


def test_max_grad_norm_clips_the_average_gradient_by_a_sketched_norm() -> None:
    """tests/workers/clipping.py: max_grad_norm_clips_the_average_gradient, then
    sketch_estimates_the_norm (the estimate's error against the math), in one launch."""
    assert_all_ok(launch("clipping", "sketch_and_clip", 2, timeout=180))


def test_max_grad_norm_is_only_for_directions() -> None:
    """Where .grad holds the average gradient, clip_grad_norm_ is the way (after GradScaler.unscale_)."""
    opt = optim.AdamW(torch.nn.Linear(4, 4).parameters())
    for compressor, optimizer in ((compressors.FP16(), opt), (compressors.Ternary(), None)):
        with pytest.raises(ValueError, match="clip_grad_norm_"):
            hooks.CompressionState(compressor=compressor, optimizer=optimizer, max_grad_norm=1.0)
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="positive"):
            hooks.CompressionState(compressor=compressors.Ternary(), optimizer=opt, max_grad_norm=bad)
