"""torch.distributed API conformance of the ddlcomm backend beyond the common collectives:
all_gather_coalesced, receives from any rank, the monitored barrier, set_timeout, coalescing,
complex dtypes, PREMUL_SUM, profiler spans, sparse all-reduce and waits in any order; 2 and 4
ranks, checked against gloo or computed directly."""

from __future__ import annotations

import pytest

from harness import assert_all_ok, launch

SCENARIOS = ["all_gather_coalesced", "recv_any_source", "monitored_barrier", "set_timeout", "coalescing",
             "complex_dtypes", "premul_sum", "profiler_spans", "sparse_allreduce", "waits_in_any_order"]


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_conformance(scenario: str, world_size: int) -> None:
    assert_all_ok(launch("conformance", scenario, world_size, timeout=120))
