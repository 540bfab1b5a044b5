"""Top-k selection (ddlcomm.compressors.TopK, csrc/compress/topk.cc): exact and approximate top-k
pick the k largest magnitudes, ties to the lower index, NaN largest."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from compress_cases import APPROX_MIN_NUMEL, assert_error_feedback, header, sparse_entries
from ddlcomm.compressors import TopK


# ---- top-k selection --------------------------------------------------------------------------


def reference_top_k(y: torch.Tensor, k: int) -> torch.Tensor:
    """Indices (ascending) of the k largest magnitude keys (|y| bits: NaN largest), ties to the lower index."""
    key = y.view(torch.int32).long() & 0x7FFFFFFF
    return torch.sort(key, descending=True, stable=True).indices[:k].sort().values


@pytest.mark.parametrize("numel", [10, 1000, APPROX_MIN_NUMEL + 3])
def test_top_k_matches_torch_topk_on_distinct_values(numel: int) -> None:
    gen = torch.Generator().manual_seed(5)
    x = (torch.randperm(numel, generator=gen) + 1).float() * (torch.randint(0, 2, (numel,), generator=gen) * 2 - 1)
    for approximate in (False, True):
        compressor = TopK(ratio=0.01, approximate=approximate)
        k = compressor.kept_entries(numel)
        indices, values = sparse_entries(compressor.encode(x))
        expected = torch.topk(x.abs(), k).indices.sort().values
        assert torch.equal(indices, expected) and torch.equal(values, x[expected])


@settings(max_examples=40, deadline=None, derandomize=True)
@given(data=st.lists(st.integers(-4, 4), min_size=1, max_size=300), k=st.integers(1, 300))
def test_top_k_breaks_ties_by_lower_index(data: list[int], k: int) -> None:
    x = torch.tensor(data, dtype=torch.float32)
    indices, _ = sparse_entries(TopK(k=k).encode(x))
    assert torch.equal(indices, reference_top_k(x, min(k, len(data))))


def test_top_k_counts_nan_as_largest() -> None:
    x = torch.tensor([1.0, float("nan"), -5.0, float("-inf"), 2.0, float("nan"), 3.0])
    indices, values = sparse_entries(TopK(k=4).encode(x))
    assert indices.tolist() == [1, 2, 3, 5]
    assert values[0].isnan() and values[1] == -5 and values[2] == -torch.inf and values[3].isnan()


@pytest.mark.parametrize("kind", ["distinct", "ties", "tie_heavy_fallback", "float16"])
def test_approximate_top_k_equals_exact(kind: str) -> None:
    """Exactly k entries, the same bytes and residual as exact top-k, with and without sampling luck."""
    numel = APPROX_MIN_NUMEL + 1001
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(numel, generator=gen)
    if kind == "ties":
        x = torch.randint(-60, 60, (numel,), generator=gen).float()
    elif kind == "tie_heavy_fallback":  # the sampled threshold hits 99% equal values: too many candidates
        x = torch.where(torch.rand(numel, generator=gen) < 0.99, 1.0, 2.0 + torch.rand(numel, generator=gen))
    elif kind == "float16":
        x = x.half()
    residual = torch.zeros(numel) if kind.startswith("tie") else 0.1 * torch.randn(numel, generator=gen)
    y = x.float() + residual
    results = []
    for approximate in (False, True):
        r = residual.clone()
        compressor = TopK(ratio=0.01, approximate=approximate)
        payload = compressor.encode(x, r, stream=1)
        assert header(payload)["k"] == compressor.kept_entries(numel)
        assert_error_feedback(y, compressor.decode(payload), r)
        results.append((payload, r))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    assert torch.equal(sparse_entries(results[0][0])[0], reference_top_k(y, TopK().kept_entries(numel)))
