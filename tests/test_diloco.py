"""Outer steps (ddlcomm.diloco): run on every rank by tests/workers/diloco.py."""

from __future__ import annotations

import functools
import logging
from typing import Any

import pytest
import torch
import torch.distributed as dist

from harness import assert_all_ok, launch
from workers import diloco, diloco_levels

from ddlcomm import compressors, optim
from ddlcomm.diloco import DiLoCo


@pytest.mark.parametrize("backend", ["ddlcomm", "gloo"])
def test_float32_outer_steps_match_a_direct_implementation(backend: str) -> None:
    # Two ranks: a sum of two is the same in any order, so the reference's per-parameter
    # all-reduces and DiLoCo's flat one agree to the bit (AdamW would amplify a rounding difference).
    assert_all_ok(launch(diloco.matches_reference, 2, timeout=120, args=(backend,)))


@pytest.mark.parametrize("backend", ["ddlcomm", "gloo"])
def test_warmup_steps_train_as_ddp(backend: str) -> None:
    assert_all_ok(launch(diloco.warmup_matches_ddp, 2, timeout=120, args=(backend,)))


@pytest.mark.parametrize("backend,names", [("ddlcomm", "onebit,topk"), ("gloo", "ternary")])
def test_error_feedback_conserves_the_pseudo_gradient(backend: str, names: str) -> None:
    assert_all_ok(launch(diloco.conservation, 4, timeout=120, args=(backend, names)))


@pytest.mark.parametrize("backend,names", [("ddlcomm", "ternary,topk,onebit+directions"),
                                           ("gloo", "onebit,ternary+directions")])
def test_compressed_warmup_shares_the_step_and_conserves_the_gradient(backend: str, names: str) -> None:
    assert_all_ok(launch(diloco.warmup_conservation, 4, timeout=120, args=(backend, names)))


@pytest.mark.parametrize("backend,names", [("ddlcomm", "ternary,none,ternary+stream,ternary+warmup,onebit+cwarmup"),
                                           ("gloo", "onebit+stream")])
def test_replicas_agree_and_resume_is_exact(backend: str, names: str) -> None:
    assert_all_ok(launch(diloco.resume, 2, timeout=120, args=(backend, names)))


def test_streamed_outer_steps_match_a_direct_implementation() -> None:
    assert_all_ok(launch(diloco.streaming_matches_reference, 2, timeout=120, args=("ddlcomm",)))


@pytest.mark.parametrize("backend", ["ddlcomm", "gloo"])
def test_a_warmup_step_skipped_on_one_rank_is_taken_by_none(backend: str) -> None:
    assert_all_ok(launch(diloco.warmup_skip, 3, timeout=120, args=(backend,)))


def test_bad_arguments_and_non_finite_pseudo_gradients_are_refused() -> None:
    assert_all_ok(launch(diloco.errors, 2, timeout=120))


@pytest.mark.parametrize("backend", ["ddlcomm", "gloo"])
def test_two_levels_replicas_of_two_ranks_each_sync_half(backend: str) -> None:
    assert_all_ok(launch(diloco_levels.two_levels, 4, timeout=180, args=(backend,)))


@pytest.mark.parametrize("compressor, warned", [
    (compressors.OneBit(), True), (compressors.TopK(ratio=0.05), True), (compressors.Ternary(), False),
    (None, False),
])
def test_outer_compressors_that_lost_accuracy_say_so(caplog: pytest.LogCaptureFixture,
                                                     compressor: compressors.Compressor, warned: bool) -> None:
    """1-bit and top-k outer steps ended further above DDP's loss than ternary on the
    transformer (docs/results/diloco.md, diloco_topk/): DiLoCo says so once, when made."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = torch.nn.Linear(4, 4)
        with caplog.at_level(logging.WARNING, logger="ddlcomm.diloco"):
            DiLoCo(model, torch.optim.AdamW(model.parameters()), compressor=compressor)
    finally:
        dist.destroy_process_group()
    assert ("consider Ternary()" in caplog.text) is warned, caplog.text


@pytest.mark.parametrize("optimizer, warned", [
    (torch.optim.AdamW, True), (torch.optim.Adam, True), (optim.AdamW, True),
    (functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9, nesterov=True), False),
])
def test_outer_steps_over_adam_replicas_say_what_they_cost(caplog: pytest.LogCaptureFixture, optimizer: Any,
                                                           warned: bool) -> None:
    """With Adam or AdamW inside, outer steps missed the 2% goal on the transformer and lost
    accuracy on the CNN at every outer setting measured (docs/results/outer_steps), and with SGD
    they did not: DiLoCo says so once, when made, with what helped."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = torch.nn.Linear(4, 4)
        with caplog.at_level(logging.WARNING, logger="ddlcomm.diloco"):
            DiLoCo(model, optimizer(model.parameters()), compressor=compressors.Ternary())
    finally:
        dist.destroy_process_group()
    assert ("missed DDP's loss by more than 2%" in caplog.text) is warned, caplog.text
    assert ("warmup_steps=10" in caplog.text) is warned
