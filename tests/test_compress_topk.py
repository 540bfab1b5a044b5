"""Top-k selection (ddlcomm.compressors.TopK, csrc/compress/topk.cc): exact and approximate top-k
pick the k largest magnitudes, ties to the lower index, NaN largest; value codes (value_bits,
csrc/compress/sparse.cc) follow the contract in compress.h."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from compress_cases import APPROX_MIN_NUMEL, assert_error_feedback, header, sparse_entries, value_codes, with_header
from ddlcomm import _C, compressors
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


# ---- value codes ------------------------------------------------------------------------------


def reference_value_codes(y: torch.Tensor, k: int, bits: int) -> tuple[list[int], list[float]]:
    """The codes and table of compress.h's contract, in plain Python: equal-count magnitude bins
    by rank (ties to the lower index), a sign, and each code's mean in float64 (32 lanes of
    sums in index order, then their tree)."""
    kept = reference_top_k(y, k).tolist()
    values = [float(y[i]) for i in kept]
    keys = [int(y[i].view(torch.int32)) & 0x7FFFFFFF for i in kept]
    levels = 1 << (bits - 1)
    order = sorted(range(k), key=lambda e: (-keys[e], e))
    codes = [0] * k
    for rank, e in enumerate(order):
        codes[e] = rank * levels // k + (0 if values[e] >= 0 else levels)
    table = []
    for c in range(2 * levels):
        lanes, count = [0.0] * 32, 0
        for e in range(k):
            if codes[e] == c:
                lanes[e % 32] += values[e]
                count += 1
        width = 16
        while width:
            for j in range(width):
                lanes[j] += lanes[j + width]
            width //= 2
        table.append(float(torch.tensor(lanes[0] / count if count else 0.0, dtype=torch.float64).float()))
    return codes, table


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("kind", ["normal", "ties", "non_finite", "float16"])
def test_value_codes_follow_the_contract(bits: int, kind: str) -> None:
    gen = torch.Generator().manual_seed(bits)
    x = torch.randn(3001, generator=gen) * torch.rand(3001, generator=gen) ** 3
    if kind == "ties":
        x = torch.randint(-6, 7, (3001,), generator=gen).float()
    elif kind == "non_finite":
        x[[5, 70, 900]] = torch.tensor([float("nan"), float("inf"), float("-inf")])
    elif kind == "float16":
        x = x.half()
    residual = 0.01 * torch.randn(3001, generator=gen)
    y = x.float() + residual
    compressor = TopK(k=301, value_bits=bits)
    payload = compressor.encode(x, residual, stream=3)
    assert header(payload)["value_bits"] == bits and compressors.inspect(payload)["value_bits"] == bits
    assert payload.numel() == 32 + 4 * 301 + (4 << bits) + (301 * bits + 7) // 8 == compressor.compressed_nbytes(3001)
    codes, table = reference_value_codes(y, 301, bits)
    indices, decoded = sparse_entries(payload)
    assert torch.equal(indices, reference_top_k(y, 301))
    assert value_codes(payload).tolist() == codes
    got_table = payload[32 + 4 * 301:32 + 4 * 301 + (4 << bits)].clone().view(torch.float32)
    assert torch.equal(got_table, torch.tensor(table)) or kind == "non_finite"
    if kind == "non_finite":  # NaN != NaN: compare the finite entries, and where the others are
        assert torch.equal(got_table.isnan(), torch.tensor(table).isnan())
        assert torch.equal(got_table.nan_to_num(), torch.tensor(table).nan_to_num())
    # The residual keeps what the codes lose: zero where the decoded value is not finite.
    full = compressor.decode(payload)
    finite = torch.isfinite(full) & torch.isfinite(y)
    assert_error_feedback(y[finite], full[finite], residual[finite])
    assert torch.all(residual[~torch.isfinite(full)] == 0)


@pytest.mark.parametrize("bits", [1, 2, 4])
def test_value_codes_keep_each_codes_sum_and_bins_have_equal_counts(bits: int) -> None:
    gen = torch.Generator().manual_seed(11)
    y = torch.randn(50_000, generator=gen) ** 3
    compressor = TopK(ratio=0.02, value_bits=bits)
    payload = compressor.encode(y)
    indices, decoded = sparse_entries(payload)
    codes = value_codes(payload)
    levels = 1 << (bits - 1)
    counts = torch.bincount(codes % levels, minlength=levels)
    assert counts.max() - counts.min() <= 1  # bins by rank: k / L entries each
    for c in codes.unique():
        sent = y[indices][codes == c].double().sum()
        assert abs(decoded[codes == c].double().sum() - sent) <= 1e-6 * abs(sent)
    # Magnitude bins are ordered: bin 0 holds the largest |y|.
    magnitude = y[indices].abs()
    for b in range(levels - 1):
        assert magnitude[codes % levels == b].min() >= magnitude[codes % levels == b + 1].max()


def test_value_codes_error_shrinks_with_bits() -> None:
    """Each width cuts the kept entries' squared error (a heavy-tailed vector), and the decoded
    vector stays closer to y than without the entries at all."""
    y = torch.randn(100_000, generator=torch.Generator().manual_seed(2)) ** 3
    errors = []
    for bits in (1, 2, 4, 8, 32):
        decoded = TopK(ratio=0.01, value_bits=bits).decode(TopK(ratio=0.01, value_bits=bits).encode(y))
        errors.append(float((decoded - y).norm()))
    assert all(a > b for a, b in zip(errors, errors[1:])), errors
    assert errors[0] < float(y.norm())


def test_value_codes_are_checked() -> None:
    payload = TopK(k=10, value_bits=2).encode(torch.randn(100))
    for bad in (with_header(payload, value_bits=3), with_header(payload, value_bits=4)):
        with pytest.raises(ValueError, match="value bits|bytes"):
            compressors.inspect(bad)
    spare = payload.clone()
    spare[-1] |= 0xF0  # 10 entries x 2 bits: the last byte's high nibble is unused
    with pytest.raises(ValueError, match="unused bits"):
        compressors.inspect(spare)
    with pytest.raises(ValueError, match="value bits"):
        compressors.inspect(with_header(TopK(k=10).encode(torch.randn(100)), value_bits=3))
    for bits in (0, 3, 16, 64):
        with pytest.raises(ValueError, match="value_bits"):
            TopK(value_bits=bits)
    with pytest.raises(TypeError):
        TopK(value_bits=2.0)  # type: ignore[arg-type]
    # A receiver that expects other codes refuses the payload (what the collectives check).
    with pytest.raises(ValueError, match="2-bit values.*expects top_k .*4-bit values"):
        _C.compress.check_payload_config(payload.data_ptr(), payload.numel(), TopK(value_bits=4).config)
