"""Soak test, short version: random collectives of every kind on 4 ranks, each result checked
against a reference (tests/workers/soak.py). The long run is bench/soak.py (docs/results/soak.md)."""

from __future__ import annotations

import re

from harness import RankResult, assert_all_ok, launch, soak_summary

OPS = 500
MAX_BYTES = 8 << 20


def summary(result: RankResult) -> dict:
    s = soak_summary(result)
    assert s is not None, f"rank {result.rank} printed no summary:\n{result.output[-2000:]}"
    return s


def test_soak_random_collectives() -> None:
    # About 20 s on 2 busy cores; the timeout turns a hang into a failure.
    results = launch("soak", "soak", 4, timeout=180, args=(str(OPS), "1", str(MAX_BYTES)))
    assert_all_ok(results)
    for s in map(summary, results):
        assert s["ops"] == OPS and sum(s["kinds"].values()) == OPS and s["mismatches"] == 0, s
    # The warm-up runs every kind (compressed_all_reduce once per compressor); every kind must
    # also come up in the random part.
    s = summary(results[0])
    random_part = {kind: s["kinds"].get(kind, 0) - n for kind, n in s["warmup_kinds"].items()}
    assert min(random_part.values()) >= 1, random_part


def test_soak_reports_wrong_results() -> None:
    """The checker's self-test: results corrupted from step 20 on must fail the run, naming the op."""
    results = launch("soak", "soak", 4, timeout=120, args=("40", "2", str(1 << 20), "20"))
    for r in results:
        assert r.returncode != 0, f"rank {r.rank} passed with corrupted results"
        reported = [int(step) for step in re.findall(rf"rank {r.rank} step (\d+) \w+ async=", r.output)]
        assert "mismatches, the first ones" in r.output and reported, r.output[-2000:]
        assert min(reported) >= 20, f"rank {r.rank} reported a mismatch before the corruption: {min(reported)}"
