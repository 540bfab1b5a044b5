"""The hosts a group spans (DDLCOMM_HOST_ID names them here; network namespaces in
tests/test_slownet_ddlcomm.py), the hierarchical all-reduce over them, and the network
transport auto takes from every rank's record."""

from __future__ import annotations

import os
import shutil

import pytest

import ddlcomm
from harness import assert_all_ok, launch, named_hosts
from workers import topology


def test_hierarchical_all_reduce_over_two_hosts_of_two_ranks() -> None:
    hosts = named_hosts()
    assert_all_ok(launch(topology.hierarchical, 4, timeout=180, rank_env=hosts))


@pytest.mark.parametrize("hosts, per_host", [(8, 1), (4, 2)])
def test_hierarchical_all_reduce_over_more_hosts(hosts: int, per_host: int) -> None:
    """8 hosts: halving-doubling across them (3 steps each way where a ring takes 7); 4: a ring."""
    ranks = named_hosts(hosts, per_host)
    assert_all_ok(launch(topology.many_hosts, hosts * per_host, timeout=240, rank_env=ranks,
                         args=(f"{hosts} hosts x {per_host} rank{'s' if per_host > 1 else ''}",)))


@pytest.mark.parametrize("algorithm, fast_inside, layered", [
    (None, True, True), (None, False, False), ("hierarchical", False, True), ("ring", True, False)])
def test_host_plan_of_other_backends(algorithm: str | None, fast_inside: bool, layered: bool) -> None:
    """The plan the collectives path takes over gloo or nccl groups: two levels under auto only
    where the exact collectives inside a host are fast; the native layout."""
    plan = ddlcomm.ProcessGroupDdlcomm.compressed_allreduce_host_plan(
        ["a", "a", "b", "b"], 1, 10, algorithm=algorithm, fast_inside=fast_inside)
    assert (plan is not None) == layered
    if layered:
        # Flat chunks of 10 over 4 ranks: 2, 3, 2, 3. Local rank 0 holds the chunks of ranks 0
        # and 2 (2 + 2), local rank 1 those of ranks 1 and 3 (3 + 3), reduced across by rank 1 with 3.
        assert plan["topology"] == "2 hosts x 2 ranks"
        assert plan["host_ranks"] == [0, 1] and plan["across_ranks"] == [1, 3]
        assert plan["server_chunks"] == [(4, 7)]
    with pytest.raises(ValueError, match="same number of ranks on every host; this group has 2 hosts of 2 and 1"):
        ddlcomm.ProcessGroupDdlcomm.compressed_allreduce_host_plan(["a", "a", "b"], 0, 10, algorithm="hierarchical")


def test_hierarchy_needs_as_many_ranks_on_every_host() -> None:
    hosts = {0: {"DDLCOMM_HOST_ID": "a"}, 1: {"DDLCOMM_HOST_ID": "a"}, 2: {"DDLCOMM_HOST_ID": "b"}}
    assert_all_ok(launch(topology.unequal_hosts, 3, timeout=120, rank_env=hosts))


# A rank's view of /sys/class in a mount namespace of its own: the real entries bound back
# over a tmpfs, with an RDMA device listed (rdma) or /sys/class/infiniband hidden (none).
_SYS_CLASS = """set -e
mount --make-rprivate /
real=$(mktemp -d)
mount --bind /sys/class "$real"
mount -t tmpfs ddlcomm-test /sys/class
for entry in "$real"/*; do
  name=$(basename "$entry")
  [ "$name" = infiniband ] && continue
  mkdir "/sys/class/$name"
  mount --bind "$entry" "/sys/class/$name"
done
if [ "$DDLCOMM_TEST_RDMA" = rdma ]; then mkdir -p /sys/class/infiniband/ddlcomm_test0; fi
exec "$@"
"""


def _with_rdma(view: str) -> list[str]:
    return ["env", f"DDLCOMM_TEST_RDMA={view}", "unshare", "--mount", "sh", "-c", _SYS_CLASS, "sh"]


needs_mount_namespaces = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare (util-linux)")


@needs_mount_namespaces
def test_auto_takes_tcp_unless_every_rank_has_rdma() -> None:
    """Rank 0 lists an RDMA device and rank 1 none: both take TCP (each deciding alone, rank 0
    took UCX and rank 1 TCP, and neither connected)."""
    results = launch(topology.network, 2, timeout=120, args=("tcp",),
                     rank_prefix={0: _with_rdma("rdma"), 1: _with_rdma("none")})
    assert_all_ok(results)


@needs_mount_namespaces
@pytest.mark.skipif("ucx" not in ddlcomm.transports(), reason="this build has no UCX transport")
def test_auto_takes_ucx_when_every_rank_has_rdma() -> None:
    results = launch(topology.network, 2, timeout=120, args=("ucx",),
                     rank_prefix={0: _with_rdma("rdma"), 1: _with_rdma("rdma")})
    assert_all_ok(results)
