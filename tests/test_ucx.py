"""The UCX transport (DDLCOMM_TRANSPORT=ucx) over UCX's tcp and shared memory transports:
collectives, receives from any rank, a killed peer and a collective mismatch, with the
workers the TCP transport is tested with. Skipped when ddlcomm was built without UCX."""

from __future__ import annotations

import signal

import pytest

from harness import assert_all_ok, launch

ddlcomm = pytest.importorskip("ddlcomm")
if not ddlcomm._C._ucx_built():
    pytest.skip("this build of ddlcomm has no UCX transport (pkg-config found no ucx; apt-get install libucx-dev)",
                allow_module_level=True)

# UCX's own transport choice, spelled as UCX_TLS. Shared memory endpoints cannot report a
# peer's failure in UCX 1.13, so there the transport watches the peer's process instead; and
# without UCX's error handling a CMA copy from a process that just died is fatal to UCX, so
# the fault test uses shared memory without CMA ("posix,sysv"), as docs suggest for jobs
# that must survive a peer's death.
WIRES = {"tcp": "tcp,self", "sm": "sm,self", "sm-without-cma": "posix,sysv,self"}


def ucx(wire: str) -> dict[str, str]:
    return {"DDLCOMM_TRANSPORT": "ucx", "UCX_TLS": WIRES[wire]}


@pytest.mark.parametrize("wire", ["tcp", "sm"])
def test_collectives(wire: str) -> None:
    assert_all_ok(launch("collectives", "collectives", 2, timeout=120, env=ucx(wire)))


def test_receive_from_any_rank() -> None:
    assert_all_ok(launch("conformance", "recv_any_source", 3, timeout=120, env=ucx("tcp")))


@pytest.mark.parametrize("wire", ["tcp", "sm-without-cma"])
def test_killed_peer_is_named(wire: str) -> None:
    results = launch("faults", "peer_killed", 3, timeout=90, args=("during",), env=ucx(wire))
    assert results[1].returncode == -signal.SIGKILL, results[1].output
    assert_all_ok([r for r in results if r.rank != 1])


# Each rank gets a longer message than it expects (UCX truncates it) or a shorter one: eager
# (40 bytes) and rendezvous (400 KB) messages.
@pytest.mark.parametrize("scenario", ["small_size_mismatch", "size_mismatch"])
def test_mismatch_raises_on_every_rank(scenario: str) -> None:
    assert_all_ok(launch("faults", scenario, 2, timeout=60, env=ucx("tcp")))


def test_point_to_point_size_mismatch_raises() -> None:
    assert_all_ok(launch("faults", "p2p_size_mismatch", 2, timeout=60, env=ucx("tcp")))
