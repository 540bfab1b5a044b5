"""Which transport carries what: shared memory between the ranks of one host, the network
between hosts (emulated by pid namespaces), and nothing left behind. The collective,
compressed, fault and soak tests run over every transport (see their parametrizations)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator

import pytest

from harness import assert_all_ok, launch, transport_env, transports
from workers import faults
from workers import transports as transport_scenarios


def dev_shm() -> set[str]:
    return set(os.listdir("/dev/shm"))


def test_collectives_use_shared_memory_and_leave_nothing() -> None:
    before = dev_shm()
    assert_all_ok(launch(transport_scenarios.shared_memory_used, 4, env={"DDLCOMM_TRANSPORT": "shm"}))
    assert dev_shm() == before


def test_nothing_is_left_after_sigkill() -> None:
    """Regions are anonymous (memfd): a rank killed mid-collective leaves no file anywhere."""
    before = dev_shm()
    results = launch(faults.peer_killed, 4, timeout=90, args=("during",), env={"DDLCOMM_TRANSPORT": "shm"})
    assert results[1].returncode == -signal.SIGKILL, results[1].output
    assert_all_ok([r for r in results if r.rank != 1])
    assert dev_shm() == before


@contextlib.contextmanager
def pid_namespaces(count: int) -> Iterator[list[list[str]]]:
    """`count` pid namespaces (each with its own /proc), as nsenter prefixes that start a
    command inside one: what a rank sees of another host, short of another kernel."""
    if os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("nsenter"):
        pytest.skip("needs root, unshare and nsenter (util-linux)")
    holders = [subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", "sleep", "600"]) for _ in range(count)]
    try:
        prefixes = []
        for holder in holders:
            for _ in range(100):  # the namespace's init is unshare's child, once forked
                children = subprocess.run(["pgrep", "-P", str(holder.pid)], capture_output=True, text=True).stdout.split()
                if children:
                    break
                time.sleep(0.05)
            assert children, "unshare did not start its namespace"
            prefixes.append(["nsenter", "--target", children[0], "--pid", "--mount", "--"])
        yield prefixes
    finally:
        for holder in holders:
            holder.kill()
            holder.wait()


@pytest.mark.parametrize("transport", transports())
@pytest.mark.parametrize("world_size", [2, 4])
def test_waiting_spins_unless_ranks_outnumber_cores(transport: str, world_size: int) -> None:
    assert_all_ok(launch(transport_scenarios.spin_choice, world_size, env=transport_env(transport)))


@pytest.mark.parametrize("variable", ["DDLCOMM_TCP_SPIN_US", "DDLCOMM_SHM_SPIN_US"])
def test_a_users_spin_replaces_the_choice(variable: str) -> None:
    assert_all_ok(launch(transport_scenarios.spin_choice, 4, env={variable: "7"}))


def test_two_hosts_mix_shared_memory_and_tcp() -> None:
    with pid_namespaces(2) as (a, b):
        assert_all_ok(launch(transport_scenarios.mixed_hosts, 4, timeout=120, rank_prefix={0: a, 1: a, 2: b, 3: b}))


def test_host_id_states_the_topology_on_one_machine() -> None:
    """DDLCOMM_HOST_ID names the host: ranks 0-1 and 2-3 as two hosts of one machine, shared
    memory inside each, TCP between them, as two pid namespaces make them above."""
    hosts = {r: {"DDLCOMM_HOST_ID": f"host-{r // 2}"} for r in range(4)}
    assert_all_ok(launch(transport_scenarios.mixed_hosts, 4, timeout=120, rank_env=hosts))


@pytest.mark.parametrize("when", ["during", "after"])
def test_killed_peer_on_a_mixed_group_is_named_by_every_survivor(when: str) -> None:
    """Two "hosts" of 2 ranks: rank 1 dies; rank 0 reaches it over shared memory layered on
    TCP, ranks 2 and 3 over TCP. Every survivor raises DistBackendError naming rank 1 within
    the timeout (tests/workers/faults.py, peer_killed)."""
    with pid_namespaces(2) as (a, b):
        results = launch(faults.peer_killed, 4, timeout=90, args=(when,), rank_prefix={0: a, 1: a, 2: b, 3: b})
    assert results[1].returncode == -signal.SIGKILL, results[1].output
    assert_all_ok([r for r in results if r.rank != 1])


def test_shm_alone_is_refused_across_hosts() -> None:
    with pid_namespaces(2) as (a, b):
        assert_all_ok(launch(transport_scenarios.shm_refused_across_hosts, 2, timeout=60, rank_prefix={0: a, 1: b},
                             env={"DDLCOMM_TRANSPORT": "shm"}))
