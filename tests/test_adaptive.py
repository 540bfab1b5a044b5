"""Adaptive compression per DDP bucket (ddlcomm.adaptive): the choice rule, the same choice on
every rank, nothing lost when a bucket switches between exact, bf16 and a lossy compressor,
and checkpoints. Its speed against fixed choices is a benchmark (docs/compression.md)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import pytest

from ddlcomm.compressors import OneBit
from harness import assert_all_ok, launch, launch_script, named_hosts
from workers import adaptive


@pytest.mark.parametrize("scenario", [adaptive.choice_rule, adaptive.per_bucket_plan, adaptive.misuse_is_refused],
                         ids=lambda f: f.__name__)
def test_choice_rule_and_misuse(scenario: Callable[[], None]) -> None:
    assert_all_ok(launch(scenario, 2, timeout=120))


@pytest.mark.parametrize("hosts,algorithm", [(1, "auto"), (2, "auto"), (2, "hierarchical")])
def test_switching_options_loses_nothing(hosts: int, algorithm: str) -> None:
    """On 2 hosts x 2 ranks the server residuals lie where the hierarchical plan puts them, and
    the ddlcomm group (under auto; the gloo group too where forced) also tries one level."""
    where = {r: {"DDLCOMM_HOST_ID": f"host-{r * hosts // 4}"} for r in range(4)}
    assert_all_ok(launch(adaptive.nothing_is_lost, 4, timeout=180, rank_env=where,
                         env={"DDLCOMM_ALLREDUCE_ALGO": algorithm}))


def test_ranks_train_and_choose_alike() -> None:
    assert_all_ok(launch(adaptive.trains_alike_everywhere, 2, timeout=240))


def test_paired_benchmark_reports_ratios_over_two_hosts() -> None:
    """bench.adaptive_paired (whose runs docs/results/across_hosts.md reports), small, on 2 named
    hosts of 2 ranks: every method reports its paired ratios to the fixed hooks, and the
    adaptive hook measured four options (one level among them) and chose one of them."""
    import bench.adaptive_paired as paired

    methods = ["fixed 1-bit hook", "fixed 1-bit hook (one level)", "adaptive 1-bit hook"]
    results = launch_script(Path(paired.__file__), 4, timeout=240, rank_env=named_hosts(),
                            args=("--width", "256", "--depth", "1", "--rounds", "3", "--methods", ",".join(methods)))
    assert_all_ok(results)
    records = [json.loads(line[len("RESULT "):]) for line in results[0].output.splitlines()
               if line.startswith("RESULT ")]
    assert [r["method"] for r in records] == methods, results[0].output[-2000:]
    for record in records:
        others = {f"ratio_to {m}" for m in methods[:2] if m != record["method"]}
        assert others <= set(record) and all(len(record[k]) == 3 and record[k][0] > 0 for k in others), record
    chosen, onebit = records[-1], repr(OneBit())
    assert len(chosen["measured"]) in (4, 5), chosen  # a plan per bucket the fifth, where one was tried
    assert chosen["choice"] in ("exact", "BF16()", onebit, f"{onebit} one level") or (
        chosen["choice"].startswith("per bucket [") and len(chosen["measured"]) == 5), chosen
