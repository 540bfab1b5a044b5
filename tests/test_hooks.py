"""Compressed all-reduce and the DDP hooks: bitwise agreement (native vs fallback, across
ranks), non-finite gradients, checkpointing and no_sync. Training quality: test_convergence.py."""

from __future__ import annotations

import logging

import pytest
import torch

from ddlcomm import hooks
from harness import assert_all_ok, launch


def test_native_and_fallback_agree_bitwise() -> None:
    assert_all_ok(launch("compression", "native_matches_fallback", 4, timeout=180))


def test_segmented_native_and_fallback_agree_bitwise() -> None:
    assert_all_ok(launch("compression", "segmented_matches_fallback", 4, timeout=240))


def test_state_versions(caplog: pytest.LogCaptureFixture) -> None:
    """A version-1 state (unsegmented server residuals) keeps everything but its server
    residuals; the current version round-trips them; a newer version is refused."""
    old = {"iter": 7, "worker_residuals": {0: torch.ones(5)}, "server_residuals": {0: torch.ones(2)},
           "momenta": {0: torch.full((5,), 2.0)}, "stats": {}}
    state = hooks.CompressionState(process_group=None)
    with caplog.at_level(logging.WARNING, logger="ddlcomm.hooks"):
        state.load_state_dict(old)
    assert "server residuals are reset" in caplog.text
    assert state.iter == 7 and state.server_residuals == {}
    assert torch.equal(state.worker_residuals[0], old["worker_residuals"][0])
    assert torch.equal(state.momenta[0], old["momenta"][0])

    state.server_residuals[0] = torch.full((2,), 3.0)
    again = hooks.CompressionState(process_group=None)
    again.load_state_dict(state.state_dict())
    assert torch.equal(again.server_residuals[0], torch.full((2,), 3.0))
    with pytest.raises(ValueError, match="newer"):
        again.load_state_dict({**state.state_dict(), "version": 99})


def test_non_finite_gradients_do_not_poison_residuals() -> None:
    assert_all_ok(launch("compression", "non_finite", 4, timeout=180))


@pytest.mark.parametrize("ranks", [2, 4])
def test_direction_mode_native_fallback_and_replicas_agree(ranks: int) -> None:
    assert_all_ok(launch("compression", "direction_mode", ranks, timeout=300))


def test_hook_mechanics() -> None:
    assert_all_ok(launch("compression", "hook_mechanics", 2, timeout=240))
