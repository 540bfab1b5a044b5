"""The hosts a group spans (DDLCOMM_HOST_ID names them here; network namespaces in
tests/test_slownet_ddlcomm.py) and the hierarchical all-reduce over them."""

from __future__ import annotations

from harness import assert_all_ok, launch


def test_hierarchical_all_reduce_over_two_hosts_of_two_ranks() -> None:
    hosts = {r: {"DDLCOMM_HOST_ID": f"host-{r // 2}"} for r in range(4)}
    assert_all_ok(launch("topology", "hierarchical", 4, timeout=180, rank_env=hosts))


def test_hierarchy_needs_as_many_ranks_on_every_host() -> None:
    hosts = {0: {"DDLCOMM_HOST_ID": "a"}, 1: {"DDLCOMM_HOST_ID": "a"}, 2: {"DDLCOMM_HOST_ID": "b"}}
    assert_all_ok(launch("topology", "unequal_hosts", 3, timeout=120, rank_env=hosts))
