"""Bad input, mismatched calls across ranks and failing peers: clear errors, no hangs."""

from __future__ import annotations

import signal
from typing import Callable

import pytest

from harness import assert_all_ok, launch, transport_env, transports
from workers import faults

# Every transport at 4 ranks (oversubscribed: these machines have 2 cores), and shm at 2.
MATRIX = [(t, 4) for t in transports()] + [("shm", 2)]


def test_bad_arguments_raise_synchronously() -> None:
    assert_all_ok(launch(faults.bad_arguments, 2))


@pytest.mark.parametrize("scenario", [faults.size_mismatch, faults.small_size_mismatch, faults.dtype_mismatch],
                         ids=lambda f: f.__name__)
@pytest.mark.parametrize("transport, world_size", MATRIX)
def test_mismatch_raises_on_every_rank(scenario: Callable[[], None], transport: str, world_size: int) -> None:
    assert_all_ok(launch(scenario, world_size, timeout=60, env=transport_env(transport)))


@pytest.mark.parametrize("transport", transports())
def test_op_mismatch(transport: str) -> None:
    assert_all_ok(launch(faults.op_mismatch, 2, timeout=60, env=transport_env(transport)))


@pytest.mark.parametrize("kind", ["cast", "block_size"])
def test_compressor_mismatch_is_refused(kind: str) -> None:
    assert_all_ok(launch(faults.compressor_mismatch, 2, timeout=60, args=(kind,)))


def test_compressed_mismatch_on_gloo_is_refused_on_every_rank() -> None:
    assert_all_ok(launch(faults.compressed_mismatch_on_gloo, 2, timeout=60))


@pytest.mark.parametrize("transport", ["tcp", "auto"], ids=["over gloo", "shared memory"])
def test_engine_over_gloo_checks_each_calls_first_message(transport: str) -> None:
    assert_all_ok(launch(faults.carrier_mismatch, 2, timeout=60, env={"DDLCOMM_TRANSPORT": transport}))


@pytest.mark.parametrize("backend", ["ddlcomm", "gloo"])
def test_hook_raises_distbackenderror_when_a_peer_dies(backend: str) -> None:
    results = launch(faults.hook_peer_killed, 4, timeout=90, args=(backend,))
    assert results[1].returncode == -signal.SIGKILL, results[1].output
    assert_all_ok([r for r in results if r.rank != 1])


@pytest.mark.parametrize("backend", ["ddlcomm", "gloo"])
def test_fsdp_reduce_scatter_raises_distbackenderror_when_a_peer_dies(backend: str) -> None:
    results = launch(faults.reduce_scatter_peer_killed, 4, timeout=90, args=(backend,))
    assert results[1].returncode == -signal.SIGKILL, results[1].output
    assert_all_ok([r for r in results if r.rank != 1])


def test_collectives_path_raises_when_a_peer_dies() -> None:
    results = launch(faults.collectives_peer_killed, 3, timeout=90)
    assert results[1].returncode == -signal.SIGKILL, results[1].output
    assert_all_ok([r for r in results if r.rank != 1])


# Every moment over tcp and shm; a kill during traffic over the others.
KILLS = [(t, when) for t in ("tcp", "shm") for when in ("before", "during", "after")] + [
    (t, "during") for t in transports() if t not in ("tcp", "shm")]


@pytest.mark.parametrize("transport, when", KILLS)
def test_killed_peer_is_named_by_every_survivor(when: str, transport: str) -> None:
    results = launch(faults.peer_killed, 4, timeout=90, args=(when,), env=transport_env(transport))
    assert results[1].returncode == -signal.SIGKILL, results[1].output
    assert_all_ok([r for r in results if r.rank != 1])


@pytest.mark.parametrize("trial", range(2))
def test_connection_reset_is_named_by_every_rank(trial: int) -> None:
    # Resets TCP sockets: meaningful over TCP only.
    assert_all_ok(launch(faults.connection_reset, 4, timeout=90, env=transport_env("tcp")))


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_straggler_beyond_timeout(transport: str) -> None:
    assert_all_ok(launch(faults.straggler, 4, timeout=60, env=transport_env(transport)))


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_straggler_named_alone_when_others_moved_on(transport: str) -> None:
    assert_all_ok(launch(faults.straggler_while_others_move_on, 3, timeout=60, env=transport_env(transport)))


def test_init_destroy_cycles_release_everything() -> None:
    assert_all_ok(launch(faults.init_destroy_cycles, 4, timeout=300, args=("100",)))
