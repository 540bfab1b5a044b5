"""torch.distributed API conformance of the ddlcomm backend beyond the common collectives:
all_gather_coalesced, receives from any rank, the monitored barrier, set_timeout, coalescing,
complex dtypes, PREMUL_SUM, profiler spans, sparse all-reduce and waits in any order; 2 and 4
ranks, checked against gloo or computed directly."""

from __future__ import annotations
from typing import Callable

import pytest

from harness import assert_all_ok, launch
from workers import conformance

SCENARIOS = [conformance.all_gather_coalesced, conformance.recv_any_source, conformance.monitored_barrier,
             conformance.set_timeout, conformance.coalescing, conformance.complex_dtypes, conformance.premul_sum,
             conformance.profiler_spans, conformance.sparse_allreduce, conformance.waits_in_any_order]


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda f: f.__name__)
def test_conformance(scenario: Callable[[], None], world_size: int) -> None:
    assert_all_ok(launch(scenario, world_size, timeout=120))
