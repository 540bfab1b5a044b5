"""Soak test, short version: random collectives of every kind on 4 ranks, each result checked
against a reference (tests/workers/soak.py). The long run is ``python -m bench.soak``
(docs/results/soak.md)."""

from __future__ import annotations

import re

import pytest

from harness import RankResult, assert_all_ok, launch, soak_summary, transport_env, transports
from workers import soak

OPS = 500
MAX_BYTES = 8 << 20


def summary(result: RankResult) -> dict:
    s = soak_summary(result)
    assert s is not None, f"rank {result.rank} printed no summary:\n{result.output[-2000:]}"
    return s


# Kinds whose result every rank checks; the others are checked by some ranks only.
CHECKED_BY_EVERY_RANK = {"all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
                         "reduce_scatter_tensor", "all_to_all_single", "all_to_all", "scatter", "compressed_all_reduce"}


@pytest.mark.parametrize("transport", transports())
def test_soak_random_collectives(transport: str) -> None:
    # About 15 s on 2 cores for the default transport (shm here), fewer operations elsewhere;
    # the timeout turns a hang into a failure.
    ops = OPS if transport == "shm" else OPS // 5
    results = launch(soak.soak, 4, timeout=180, args=(str(ops), "1", str(MAX_BYTES)), env=transport_env(transport))
    assert_all_ok(results)
    summaries = [summary(r) for r in results]
    # Exit 0 says no check failed; this says the checks ran: every operation issued was compared
    # with its reference (exit 0 would also follow from checks that were skipped).
    issued = summaries[0]["kinds"]
    assert sum(issued.values()) == ops and all(s["kinds"] == issued for s in summaries), summaries
    assert set(issued) == set(CHECKED_BY_EVERY_RANK) | {"gather", "send_recv", "barrier"}, issued
    for s in summaries:
        unchecked = {k: (issued[k], s["checked"].get(k, 0)) for k in CHECKED_BY_EVERY_RANK
                     if s["checked"].get(k, 0) != issued[k]}
        assert not unchecked, f"rank {s['rank']}: kind: (issued, checked) {unchecked}"
    checked_anywhere = {k: sum(s["checked"].get(k, 0) for s in summaries) for k in ("gather", "send_recv")}
    # Gather: its root checks each one. Send/recv: each receiver (one of a pair, every rank of a shift).
    assert checked_anywhere["gather"] == issued["gather"], checked_anywhere
    assert issued["send_recv"] <= checked_anywhere["send_recv"] <= len(summaries) * issued["send_recv"], checked_anywhere
    assert "barrier" not in summaries[0]["checked"]  # nothing to compare
    # The warm-up runs every kind (compressed_all_reduce once per compressor); every kind must
    # also come up in the random part.
    s = summary(results[0])
    random_part = {kind: s["kinds"].get(kind, 0) - n for kind, n in s["warmup_kinds"].items()}
    assert min(random_part.values()) >= 1, random_part


def test_soak_reports_wrong_results() -> None:
    """The checker's self-test: results corrupted from step 20 on must fail the run, naming the op."""
    results = launch(soak.soak, 4, timeout=120, args=("40", "2", str(1 << 20), "20"))
    for r in results:
        assert r.returncode != 0, f"rank {r.rank} passed with corrupted results"
        reported = [int(step) for step in re.findall(rf"rank {r.rank} step (\d+) \w+ async=", r.output)]
        assert "mismatches, the first ones" in r.output and reported, r.output[-2000:]
        assert min(reported) >= 20, f"rank {r.rank} reported a mismatch before the corruption: {min(reported)}"
