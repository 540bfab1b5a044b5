"""Connection authentication: the handshake's HMAC, hostile clients, disagreeing keys."""

from __future__ import annotations

import hashlib
import hmac
import re

from hypothesis import given, settings
from hypothesis import strategies as st

import ddlcomm
from harness import assert_all_ok, launch
from workers import auth


@settings(max_examples=200, deadline=None)
@given(key=st.binary(max_size=200), message=st.binary(max_size=300))
def test_hmac_matches_the_standard(key: bytes, message: bytes) -> None:
    # Covers keys longer than a block (hashed first) and messages across block boundaries.
    assert ddlcomm._C._hmac_sha256(key, message) == hmac.new(key, message, hashlib.sha256).digest()


def test_hostile_clients_are_dropped_and_the_job_runs() -> None:
    results = launch(auth.hostile_clients, 4, timeout=120, env={"DDLCOMM_HANDSHAKE_TIMEOUT_MS": "1500"})
    assert_all_ok(results)
    for r in results[:3]:  # every attacked rank logged what it dropped, and why
        summary = re.search(
            r"dropped (\d+) unauthenticated connections while connecting the group: (\d+) failed the key proof, "
            r"(\d+) too slow, (\d+) closed early, (\d+) evicted by a flood",
            r.output,
        )
        assert summary, r.output[-3000:]
        total, bad_proof, too_slow, closed, evicted = map(int, summary.groups())
        assert bad_proof == 2 + 32, summary.group(0)  # the garbage, the wrong key, a wrong byte in each place
        assert too_slow + evicted + closed >= 152, summary.group(0)  # the flood and the two slow clients
        assert evicted >= 150 + 2 - 128 and too_slow >= 2, summary.group(0)
        assert "handshake bytes within 1500 ms" in r.output


def test_disagreeing_keys_fail_fast_with_a_clear_error() -> None:
    results = launch(auth.disagreeing_keys, 2, timeout=60, rank_env={1: {"DDLCOMM_AUTH_KEY": "not the same"}})
    assert [r.returncode for r in results] == [4, 4], [r.output for r in results]
    rejected = re.search(r"DistBackendError after ([\d.]+) s: .*rejected this rank's proof", results[1].output)
    assert rejected and float(rejected.group(1)) < 5, results[1].output
    timed_out = re.search(r"DistBackendError after ([\d.]+) s: .*Timed out.*missing rank 1", results[0].output)
    assert timed_out and float(timed_out.group(1)) < 5 + 5, results[0].output


def test_disagreeing_world_sizes_are_named() -> None:
    results = launch(auth.disagreeing_sizes, 2, timeout=60)
    assert [r.returncode for r in results] == [4, 4], [r.output for r in results]
    assert "group of 3 ranks, this rank in one of 2 (the ranks disagree on the world size)" in results[0].output, \
        results[0].output
