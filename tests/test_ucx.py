"""What only the UCX transport (DDLCOMM_TRANSPORT=ucx) needs beyond the transport matrix of
test_backend, test_faults and test_soak (which run over UCX's tcp): collectives over UCX's
full shared memory (CMA included), a killed peer over UCX's shared memory without CMA,
receives from any rank, a point-to-point size mismatch, and a user's segment size. Skipped
without UCX."""

from __future__ import annotations

import signal

import pytest

from harness import assert_all_ok, launch
from workers import collectives, conformance, faults

ddlcomm = pytest.importorskip("ddlcomm")
if "ucx" not in ddlcomm.transports():
    pytest.skip("this build of ddlcomm has no UCX transport (pkg-config found no ucx; apt-get install libucx-dev)",
                allow_module_level=True)

# UCX's own transport choice, spelled as UCX_TLS. "sm" includes CMA (process_vm_readv), which
# the matrix leaves out because a peer dying during a CMA copy aborts the survivor in UCX 1.13.
WIRES = {"tcp": "tcp,self", "sm": "sm,self", "sm-without-cma": "posix,sysv,self"}


def ucx(wire: str) -> dict[str, str]:
    return {"DDLCOMM_TRANSPORT": "ucx", "UCX_TLS": WIRES[wire]}


def test_collectives_over_all_of_ucx_shared_memory() -> None:
    assert_all_ok(launch(collectives.collectives, 2, timeout=120, env=ucx("sm")))


def test_killed_peer_over_ucx_shared_memory_without_cma() -> None:
    results = launch(faults.peer_killed, 3, timeout=90, args=("during",), env=ucx("sm-without-cma"))
    assert results[1].returncode == -signal.SIGKILL, results[1].output
    assert_all_ok([r for r in results if r.rank != 1])


def test_receive_from_any_rank() -> None:
    assert_all_ok(launch(conformance.recv_any_source, 3, timeout=120, env=ucx("tcp")))


def test_point_to_point_size_mismatch_raises() -> None:
    assert_all_ok(launch(faults.p2p_size_mismatch, 2, timeout=60, env=ucx("tcp")))


def test_a_users_segment_size_replaces_both_defaults() -> None:
    # Alone beside ddlcomm's 256 KiB send segments, UCX would refuse this receive segment.
    assert_all_ok(launch(collectives.subgroups, 2, timeout=60, env={**ucx("tcp"), "UCX_TCP_RX_SEG_SIZE": "128k"}))
