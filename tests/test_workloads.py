"""Real training stacks on ddlcomm: each suite runs once on a ddlcomm group and once on a gloo
group (same inputs, same processes' worth of work); losses and parameters must agree within
float tolerance (the backends may sum in another order), and every rank must hold the same
parameters where the stack replicates them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from harness import assert_all_ok, launch
from workers import workloads

# Each workload once: on 4 ranks where that shape adds something (FSDP2 shards, checkpoint
# resharding, objects), on 2 ranks the rest (a pipeline stage per rank, a 2-way mesh).
SUITES = {
    2: ("fsdp2_divide_factor", "tensor_parallel", "pipeline", "ddp_variants"),
    4: ("fsdp2", "checkpoint", "objects"),
}
# Where every rank ends with the whole model: all of them but the pipeline (one stage each).
REPLICATED = {"fsdp2", "fsdp2_divide_factor", "tensor_parallel", "checkpoint", "ddp_variants", "objects"}


def _results(ranks: int, backend: str, names: tuple[str, ...], out: Path) -> list[dict[str, dict]]:
    """Per rank: workload -> {"losses": [...], "params": [...]}."""
    assert_all_ok(launch(workloads.suite, ranks, timeout=300, args=(backend, str(out), *names)))
    results = [json.loads((out / f"{backend}-rank{rank}.json").read_text()) for rank in range(ranks)]
    for rank, found in enumerate(results):
        assert set(found) == set(names), f"rank {rank} reported {sorted(found)}"
    return results


@pytest.mark.parametrize("ranks", sorted(SUITES))
def test_workloads_match_gloo(ranks: int, tmp_path: Path) -> None:
    ours = _results(ranks, "ddlcomm", SUITES[ranks], tmp_path)
    reference = _results(ranks, "gloo", SUITES[ranks], tmp_path)
    for rank, (mine, theirs) in enumerate(zip(ours, reference)):
        for name in SUITES[ranks]:
            for key in ("losses", "params"):
                torch.testing.assert_close(torch.tensor(mine[name][key], dtype=torch.float64),
                                           torch.tensor(theirs[name][key], dtype=torch.float64), rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"{name} on rank {rank}, {key}: {m}")
            if name in REPLICATED:
                assert mine[name]["params"] == ours[0][name]["params"], f"{name}: rank {rank} holds other parameters"


def test_sparse_embedding_gradients(tmp_path: Path) -> None:
    ours = _results(2, "ddlcomm", ("sparse_embedding",), tmp_path)
    reference = _results(2, "gloo", ("sparse_embedding",), tmp_path)
    assert ours == reference
