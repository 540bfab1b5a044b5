"""Adaptive compression per DDP bucket (ddlcomm.adaptive): the choice rule, the same choice on
every rank, nothing lost when a bucket switches between exact, bf16 and a lossy compressor,
and checkpoints. Its speed against fixed choices is a benchmark (docs/compression.md)."""

from __future__ import annotations

import pytest

from harness import assert_all_ok, launch


@pytest.mark.parametrize("scenario", ["choice_rule", "misuse_is_refused"])
def test_choice_rule_and_misuse(scenario: str) -> None:
    assert_all_ok(launch("adaptive", scenario, 2, timeout=120))


@pytest.mark.parametrize("hosts", [1, 2])
def test_switching_options_loses_nothing(hosts: int) -> None:
    """On 2 hosts x 2 ranks the server residuals lie where the hierarchical plan puts them."""
    where = {r: {"DDLCOMM_HOST_ID": f"host-{r * hosts // 4}"} for r in range(4)}
    assert_all_ok(launch("adaptive", "nothing_is_lost", 4, timeout=180, rank_env=where))


def test_ranks_train_and_choose_alike() -> None:
    assert_all_ok(launch("adaptive", "trains_alike_everywhere", 2, timeout=240))
