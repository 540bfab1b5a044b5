"""Compressors with error feedback (ddlcomm.compress, csrc/compress/)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from compress_cases import APPROX_MIN_NUMEL, COMPRESSORS, DTYPES, F32_EPS, MASK64, SIZES, header, make_input, section
from ddlcomm.compress import BF16, FP16, Compressor, OneBit, RandomK, Ternary, TopK, inspect


def assert_error_feedback(y: torch.Tensor, decoded: torch.Tensor, residual: torch.Tensor) -> None:
    """decoded + residual == y up to the two float32 roundings of residual = y - decoded."""
    err = (decoded + residual - y).abs()
    tol = 2 * F32_EPS * (y.abs() + decoded.abs()) + 1e-30
    assert torch.all(err <= tol), f"max error {err.max().item()} (tolerance {tol[err.argmax()].item()})"


# ---- error feedback, sizes, decode variants ---------------------------------------------------


@pytest.mark.parametrize("numel", SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", COMPRESSORS)
def test_error_feedback_identity(name: str, dtype: torch.dtype, numel: int) -> None:
    compressor = COMPRESSORS[name]()
    x, residual = make_input(numel, dtype)
    y = x.float() + residual
    payload = compressor.encode(x, residual, stream=5)
    assert payload.dtype == torch.uint8 and payload.numel() == compressor.compressed_nbytes(numel)
    info = inspect(payload)
    assert info["format"] == compressor.format and info["numel"] == numel and info["nbytes"] == payload.numel()
    decoded = compressor.decode(payload)
    assert decoded.dtype == torch.float32 and decoded.shape == (numel,)
    assert_error_feedback(y, decoded, residual)

    # Every other way of decoding agrees with the float32 decode.
    for out_dtype in (torch.float16, torch.bfloat16):
        assert torch.equal(compressor.decode(payload, dtype=out_dtype), decoded.to(out_dtype))
    base = torch.randn(numel)
    assert torch.equal(compressor.decode_accumulate(payload, base.clone()), base + decoded)
    out = torch.empty(numel)
    assert compressor.decode(payload, out=out, numel=numel) is out and torch.equal(out, decoded)


@pytest.mark.parametrize("name", COMPRESSORS)
def test_without_residual_matches_zero_residual(name: str) -> None:
    compressor = COMPRESSORS[name]()
    x, _ = make_input(3000, torch.float16)
    assert torch.equal(compressor.encode(x, stream=2), compressor.encode(x, torch.zeros(3000), stream=2))


def test_public_properties_say_what_each_format_sends() -> None:
    sparse = {"top_k", "random_k"}
    for compressor in (OneBit(), Ternary(), TopK(), RandomK(), FP16(), BF16()):
        assert compressor.is_sparse == (compressor.format in sparse), compressor
        assert compressor.samples_randomly == (compressor.format == "random_k"), compressor
        assert compressor.config.format == compressor._format
    assert TopK(k=5).config.k == 5


def test_encode_works_in_place_on_any_contiguous_shape() -> None:
    x, residual = make_input(6 * 70, torch.float32)
    x2d, r2d = x.view(6, 70), residual.clone().view(6, 70)
    address = r2d.data_ptr()
    payload = OneBit().encode(x2d, r2d)
    assert r2d.data_ptr() == address and not torch.equal(r2d.flatten(), residual)
    assert torch.equal(payload, OneBit().encode(x, residual))
    assert torch.equal(r2d.flatten(), residual)


def test_encode_into_a_preallocated_buffer() -> None:
    x, residual = make_input(1000, torch.float32)
    compressor = Ternary(stochastic=True, seed=1)
    expected = compressor.encode(x, residual.clone(), stream=3)
    buffer = torch.full((expected.numel() + 10,), 0xAB, dtype=torch.uint8)
    payload = compressor.encode(x, residual, stream=3, out=buffer)
    assert payload.data_ptr() == buffer.data_ptr() and torch.equal(payload, expected)
    assert torch.all(buffer[expected.numel():] == 0xAB)
    with pytest.raises(ValueError, match="bytes"):
        compressor.encode(x, out=buffer[:expected.numel() - 1])
    with pytest.raises(TypeError, match="uint8"):
        compressor.encode(x, out=torch.empty(expected.numel(), dtype=torch.int8))


@pytest.mark.parametrize("numel", [0, 1, 8, 255, 256, 257, 1000])
def test_compressed_nbytes_follows_wire_format(numel: int) -> None:
    blocks = -(-numel // 256)
    assert OneBit().compressed_nbytes(numel) == 32 + 4 * blocks + -(-numel // 8)
    assert OneBit(two_scales=True).compressed_nbytes(numel) == 32 + 8 * blocks + -(-numel // 8)
    assert Ternary().compressed_nbytes(numel) == 32 + 4 * blocks + -(-numel // 4)
    assert FP16().compressed_nbytes(numel) == BF16().compressed_nbytes(numel) == 32 + 2 * numel
    k = 0 if numel == 0 else max(1, int(0.01 * numel + 0.5))
    assert TopK().kept_entries(numel) == k and TopK().compressed_nbytes(numel) == 32 + 8 * k
    assert RandomK(k=10).kept_entries(numel) == min(10, numel)


# ---- the cross-device contract, recomputed in numpy -----------------------------------------


def lane_sum(values: np.ndarray) -> np.float32:
    """float32 sums in 32 interleaved lanes, then the fixed tree (csrc/compress/compress.h)."""
    lanes = np.zeros(32, np.float32)
    for off in range(0, len(values), 32):
        row = values[off:off + 32].astype(np.float32)
        lanes[:len(row)] += row
    width = 16
    while width:
        lanes[:width] += lanes[width:2 * width]
        width //= 2
    return lanes[0]


def counter_bits(seed: int, stream: int, index: int) -> int:
    z = seed ^ (stream * 0x9E3779B97F4A7C15 & MASK64) ^ (index * 0xBF58476D1CE4E5B9 & MASK64)
    z = (z + 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def counter_uniform(seed: int, stream: int, index: int) -> np.float32:
    return np.float32(counter_bits(seed, stream, index) >> 40) * np.float32(1.0 / 16777216.0)


@pytest.mark.parametrize("block", [256, 37])
def test_one_bit_scales_follow_the_contract(block: int) -> None:
    x, _ = make_input(3 * block + 11, torch.float32, seed=1)
    y = x.numpy()
    for two_scales in (False, True):
        payload = OneBit(block_size=block, two_scales=two_scales).encode(x)
        blocks = [y[b:b + block] for b in range(0, len(y), block)]
        scales = section(payload, 0, len(blocks) * (2 if two_scales else 1), torch.float32).numpy()
        for b, v in enumerate(blocks):
            if two_scales:
                pos, neg = v[v >= 0], -v[~(v >= 0)]
                expected = [lane_sum(np.where(v >= 0, v, 0)) / np.float32(len(pos)),
                            lane_sum(np.where(v >= 0, 0, -v)) / np.float32(len(neg))]
                assert scales[2 * b:2 * b + 2].tolist() == expected
            else:
                assert scales[b] == lane_sum(np.abs(v)) / np.float32(len(v))
        bits = section(payload, 4 * len(scales), -(-len(y) // 8), torch.uint8).numpy()
        assert np.array_equal(np.unpackbits(bits, bitorder="little")[:len(y)], (y >= 0).astype(np.uint8))


def ternary_codes(payload: torch.Tensor, numel: int, blocks: int) -> np.ndarray:
    codes = section(payload, 4 * blocks, -(-numel // 4), torch.uint8).numpy()
    return (codes[:, None] >> np.arange(0, 8, 2)).flatten()[:numel] & 3


def test_ternary_threshold_scale_and_codes_follow_the_contract() -> None:
    numel, block = 70, 32
    x, _ = make_input(numel, torch.float32, seed=2)
    x[64:] = 0.0  # a block of zeros sends nothing
    payload = Ternary(block_size=block).encode(x)
    assert not inspect(payload)["stochastic"]
    y = x.numpy()
    scales = section(payload, 0, 3, torch.float32).numpy()
    codes = ternary_codes(payload, numel, 3)
    for b in range(3):
        v = y[b * block:(b + 1) * block]
        at = (lane_sum(np.abs(v)) / np.float32(len(v))) * np.float32(0.7)
        sent = np.abs(v) > at
        expected = lane_sum(np.where(sent, np.abs(v), 0)) / np.float32(sent.sum()) if sent.any() else 0.0
        assert scales[b] == np.float32(expected)
        want = np.where(sent, np.where(v >= 0, 1, 2), 0)
        assert np.array_equal(codes[b * block:b * block + len(v)], want)


def test_ternary_threshold_error_is_below_the_signal() -> None:
    """The deterministic rule is a contraction (squared error < squared input on every block
    that sends something), which error feedback needs; stochastic rounding with s = max |y| is
    not: on Gaussian blocks its expected squared error exceeds the input's."""
    x, _ = make_input(64 * 256, torch.float32, seed=5)
    x = x * torch.linspace(0.01, 10, x.numel())  # blocks of very different scales
    for compressor, below in ((Ternary(), True), (Ternary(stochastic=True, seed=1), False)):
        err = (compressor.decode(compressor.encode(x)) - x).view(-1, 256).pow(2).sum(1)
        energy = x.view(-1, 256).pow(2).sum(1)
        if below:
            assert torch.all(err < energy), (err / energy).max()
        else:
            assert (err / energy).mean() > 1.0, (err / energy).mean()


def test_ternary_constant_block_is_exact_and_options_are_checked() -> None:
    x = torch.full((300,), -2.5)
    assert torch.equal(Ternary().decode(Ternary().encode(x)), x)
    with pytest.raises(ValueError, match="stochastic"):
        Ternary(clip=1.0)
    with pytest.raises(ValueError, match="stochastic"):
        Ternary(seed=3)
    payload = Ternary(stochastic=True).encode(x)
    assert inspect(payload)["stochastic"] and Ternary().decode(payload).numel() == 300


@pytest.mark.parametrize("clip", [0.0, 1.0])
def test_stochastic_ternary_scale_and_codes_follow_the_contract(clip: float) -> None:
    numel, block, seed, stream = 70, 32, 11, 9
    x, _ = make_input(numel, torch.float32, seed=2)
    payload = Ternary(block_size=block, stochastic=True, clip=clip, seed=seed).encode(x, stream=stream)
    y = x.numpy()
    scales = section(payload, 0, 3, torch.float32).numpy()
    codes = section(payload, 12, -(-numel // 4), torch.uint8).numpy()
    codes = (codes[:, None] >> np.arange(0, 8, 2)).flatten()[:numel] & 3
    for b in range(3):
        v = y[b * block:(b + 1) * block]
        s = np.abs(v).max()
        if clip:
            n = np.float32(len(v))
            mean = lane_sum(v) / n
            var = lane_sum(v * v) / n - mean * mean
            s = min(s, np.float32(clip) * np.sqrt(max(var, np.float32(0))))
        assert scales[b] == s
        for j, value in enumerate(v):
            i = b * block + j
            send = counter_uniform(seed, stream, i) * s < abs(value)
            assert codes[i] == (0 if not send else 1 if value >= 0 else 2)


def test_random_k_indices_follow_floyd() -> None:
    numel, k, seed, stream = 1000, 37, 5, 12
    x, _ = make_input(numel, torch.float32)
    payload = RandomK(k=k, seed=seed).encode(x, stream=stream)
    taken: set[int] = set()
    for j in range(numel - k, numel):
        t = counter_bits(seed, stream, j) * (j + 1) >> 64
        taken.add(j if t in taken else t)
    indices = section(payload, 0, k, torch.int32).long()
    assert indices.tolist() == sorted(taken)
    assert torch.equal(section(payload, 4 * k, k, torch.float32), x[indices])


# ---- statistics -------------------------------------------------------------------------------


def mean_over_streams(compressor: Compressor, x: torch.Tensor, trials: int) -> torch.Tensor:
    total = torch.zeros(x.numel(), dtype=torch.float64)  # float32 sums would drift by ~trials * eps
    for stream in range(trials):
        total += compressor.decode(compressor.encode(x, stream=stream))
    return (total / trials).float()


def test_stochastic_ternary_is_unbiased() -> None:
    x, _ = make_input(512, torch.float32, seed=3)
    trials = 2000
    mean = mean_over_streams(Ternary(block_size=64, stochastic=True, seed=1), x, trials)
    s = x.abs().view(-1, 64).amax(1).repeat_interleave(64)
    sigma = ((s * x.abs() - x * x).clamp_min(0) / trials).sqrt()  # Var = s|y| - y^2
    assert torch.all((mean - x).abs() <= 5 * sigma + 1e-6)


def test_random_k_scaled_is_unbiased_and_uniform() -> None:
    numel, k, trials = 200, 20, 4000
    x, _ = make_input(numel, torch.float32, seed=4)
    compressor = RandomK(k=k, seed=9, scaled=True)
    mean = mean_over_streams(compressor, x, trials)
    sigma = x.abs() * ((numel / k - 1) / trials) ** 0.5  # Var = y^2 (n/k - 1)
    assert torch.all((mean - x).abs() <= 5 * sigma)
    hits = torch.zeros(numel)
    for stream in range(trials):
        hits[section(compressor.encode(x, stream=stream), 0, k, torch.int32).long()] += 1
    p = k / numel
    assert torch.all((hits - trials * p).abs() <= 5 * (trials * p * (1 - p)) ** 0.5)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("numel,k", [(200, 20), (1000, 3), (4099, 7), (5, 5), (1 << 20, 3)])
def test_random_k_scaled_values_are_exact(numel: int, k: int, dtype: torch.dtype) -> None:
    """Each sent value is y * float32(numel / k) in float32 arithmetic (randomk.cc: the scale is
    float(double(numel) / double(k)), then one float32 multiply), the decoded vector holds exactly
    those, and the residual is y - decoded everywhere (y where nothing was sent). A scale off by
    any amount, even one ulp, fails here; the statistical test above cannot see a few percent."""
    x, residual = make_input(numel, dtype, seed=12)
    y = x.float() + residual
    scale = torch.tensor(numel / k, dtype=torch.float32)  # rounds the double quotient to float32
    compressor = RandomK(k=k, seed=4, scaled=True)
    payload = compressor.encode(x, residual, stream=6)
    indices, values = sparse_entries(payload)
    assert indices.numel() == k
    assert torch.equal(values, y[indices] * scale)
    decoded = compressor.decode(payload)
    expected = torch.zeros(numel)
    expected[indices] = y[indices] * scale
    assert torch.equal(decoded, expected)
    assert torch.equal(residual, y - decoded)
    unscaled = RandomK(k=k, seed=4).encode(x, stream=6)  # same indices, values y unscaled
    assert torch.equal(sparse_entries(unscaled)[0], indices)


def test_stochastic_ternary_and_random_k_depend_on_stream_and_seed() -> None:
    x, _ = make_input(1000, torch.float32)
    for make in (lambda seed: Ternary(stochastic=True, seed=seed), lambda seed: RandomK(seed=seed)):
        assert not torch.equal(make(0).encode(x, stream=1), make(0).encode(x, stream=2))
        assert not torch.equal(make(0).encode(x, stream=1), make(1).encode(x, stream=1))


# ---- top-k selection --------------------------------------------------------------------------


def reference_top_k(y: torch.Tensor, k: int) -> torch.Tensor:
    """Indices (ascending) of the k largest magnitude keys (|y| bits: NaN largest), ties to the lower index."""
    key = y.view(torch.int32).long() & 0x7FFFFFFF
    return torch.sort(key, descending=True, stable=True).indices[:k].sort().values


def sparse_entries(payload: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    k = header(payload)["k"]
    return section(payload, 0, k, torch.int32).long(), section(payload, 4 * k, k, torch.float32)


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


# ---- non-finite input ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", COMPRESSORS)
def test_non_finite_input_decodes_non_finite_and_resets_residual(name: str) -> None:
    compressor = COMPRESSORS[name]()
    x, residual = make_input(1000, torch.float32, seed=8)
    bad = [3, 300, 301]
    if compressor.samples_randomly:  # it sends what it draws: put them where it draws (indices
        bad = sparse_entries(compressor.encode(x))[0][:3].tolist()  # depend on seed and stream only)
        assert len(bad) == 3
    x[bad] = torch.tensor([float("nan"), float("inf"), float("-inf")])
    payload = compressor.encode(x, residual)
    decoded = compressor.decode(payload)
    assert not decoded[bad].isfinite().any()
    assert residual.isfinite().all() and torch.all(residual[bad] == 0)


@pytest.mark.parametrize("scaled", [False, True], ids=["unscaled", "scaled"])
def test_random_k_non_finite_sent_and_unsent(scaled: bool) -> None:
    """What the encoder promises (compress.h, "Residual"): a non-finite entry it sends decodes as
    itself (NaN stays NaN, +-inf keeps its sign, times the scale), one it does not send decodes as 0
    (the compressed all-reduce checks for those separately), and the residual is 0 at both (y -
    decoded is not finite) and y - decoded everywhere else."""
    numel, k, stream = 1000, 50, 3
    compressor = RandomK(k=k, seed=11, scaled=scaled)
    x, residual = make_input(numel, torch.float32, seed=8)
    sent = sparse_entries(compressor.encode(x, stream=stream))[0]
    unsent = [i for i in range(numel) if i not in set(sent.tolist())][:2]
    bad_sent = sent[[0, k // 2, k - 1]].tolist()
    x[bad_sent] = torch.tensor([float("nan"), float("inf"), float("-inf")])
    x[unsent] = torch.tensor([float("nan"), float("-inf")])
    y = x + residual
    payload = compressor.encode(x, residual, stream=stream)
    indices, values = sparse_entries(payload)
    assert torch.equal(indices, sent)
    decoded = compressor.decode(payload)
    assert decoded[bad_sent[0]].isnan()
    assert decoded[bad_sent[1]] == float("inf") and decoded[bad_sent[2]] == -float("inf")
    assert torch.all(decoded[unsent] == 0)
    assert torch.all(residual[bad_sent + unsent] == 0)
    good = torch.ones(numel, dtype=torch.bool)
    good[bad_sent + unsent] = False
    assert torch.equal(residual[good], (y - decoded)[good])


def float32_grid() -> torch.Tensor:
    """float32 values at every exponent (zero and subnormals, inf and NaN included), both signs,
    with mantissas that put a tie (and the values either side of it, with an even or an odd kept
    bit) at every rounding position, plus random bit patterns."""
    mantissas = {0, 1, 0x7FFFFF, 0x400000 | 1}
    for b in range(23):
        top = (0x7FFFFF >> b) << b  # all ones down to bit b: the largest values of a binade
        mantissas |= {1 << b, (1 << b) - 1, (1 << b) + 1, (3 << b) & 0x7FFFFF, 0x7FFFFF ^ (1 << b), top,
                      top | (1 << b) >> 1}
    exponents = torch.arange(256, dtype=torch.int64)
    m = torch.tensor(sorted(mantissas), dtype=torch.int64)
    bits = (exponents[:, None] << 23 | m[None, :]).flatten()
    noise = torch.randint(0, 1 << 32, (4096,), generator=torch.Generator().manual_seed(3))
    bits = torch.cat([bits, bits | (1 << 31), noise])
    return (bits - ((bits >> 31) << 32)).to(torch.int32).view(torch.float32)  # as signed int32


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, except that any NaN matches any NaN (torch's bfloat16 makes every NaN
    0xffff; csrc/common/half.h keeps its sign)."""
    nan = a.isnan()
    width = torch.int32 if a.dtype == torch.float32 else torch.int16
    return torch.equal(nan, b.isnan()) and torch.equal(a[~nan].view(width), b[~nan].view(width))


@pytest.mark.parametrize("name,dtype", [("fp16", torch.float16), ("bf16", torch.bfloat16)])
def test_casts_round_as_torch_bit_for_bit(name: str, dtype: torch.dtype) -> None:
    """decode(encode(y)) == y.to(dtype).float(): round to nearest even (ties both ways, at every
    exponent), subnormals of the target and of float32, overflow to +-inf, NaN, -0.0; over the
    float32 grid and over every float16 and bfloat16 bit pattern as input. The residual is
    y - decoded where that is finite and 0 where it is not (inf, NaN, overflow)."""
    compressor = COMPRESSORS[name]()
    every16 = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16)
    for x in (float32_grid(), every16.view(torch.float16), every16.view(torch.bfloat16)):
        y = x.float()
        expected = y.to(dtype)
        payload = compressor.encode(x)
        assert same_bits(compressor.decode(payload, dtype=dtype), expected)
        decoded = compressor.decode(payload)
        assert same_bits(decoded, expected.float())
        # With error feedback: a residual of -0.0 leaves y = x + residual equal to x bit for bit.
        residual = torch.full((x.numel(),), -0.0)
        assert torch.equal(compressor.encode(x, residual), payload)
        diff = y - decoded
        assert torch.equal(residual.view(torch.int32), torch.where(diff.isfinite(), diff, 0.0).view(torch.int32))
    # The grid holds what it claims, compared as bits (-0.0 == 0.0 as floats): fp16 ties rounding
    # down and up, half subnormal ties, the tie between 65504 and inf, a bfloat16 tie, -0.0.
    claimed = torch.tensor([1 + 2.0**-11, 1 + 3 * 2.0**-11, 2.0**-25, 3 * 2.0**-25, 65520.0, 1 + 2.0**-8, -0.0])
    assert set(claimed.view(torch.int32).tolist()) <= set(float32_grid().view(torch.int32).tolist())


def test_fp16_overflow_becomes_inf_with_zero_residual() -> None:
    x = torch.tensor([1e6, -1e6, 1.0])
    residual = torch.zeros(3)
    decoded = FP16().decode(FP16().encode(x, residual))
    assert decoded.tolist() == [float("inf"), float("-inf"), 1.0] and residual.tolist() == [0, 0, 0]


def test_top_k_with_more_non_finite_entries_than_k_keeps_residual_finite() -> None:
    x = torch.full((50,), float("nan"))
    residual = torch.zeros(50)
    TopK(k=3).encode(x, residual)
    assert torch.all(residual == 0)


# ---- determinism --------------------------------------------------------------------------------


# csrc/compress/parallel.h: each thread beyond the first needs this many elements.
MIN_ELEMENTS_PER_THREAD = 1 << 20


@pytest.mark.parametrize("name", COMPRESSORS)
def test_encode_is_deterministic_across_calls_and_thread_counts(name: str, monkeypatch) -> None:
    compressor = COMPRESSORS[name]()
    # threadsFor caps the threads at numel / 2^20: 3 threads need 3 * 2^20 elements (3,000,007
    # gave 2); the odd remainder makes the last part longer than the others.
    numel = 3 * MIN_ELEMENTS_PER_THREAD + 7
    assert min(3, numel // MIN_ELEMENTS_PER_THREAD) == 3
    x, residual = make_input(numel, torch.bfloat16, seed=9)
    results = []
    for threads in ("1", "3", "3"):
        monkeypatch.setenv("DDLCOMM_NUM_THREADS", threads)
        r = residual.clone()
        payload = compressor.encode(x, r, stream=4)
        results.append((payload, r, compressor.decode(payload)))
    for payload, r, decoded in results[1:]:
        assert torch.equal(payload, results[0][0]) and torch.equal(r, results[0][1])
        assert torch.equal(decoded, results[0][2])


@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "unaligned"])
@pytest.mark.parametrize("name", COMPRESSORS)
def test_large_float32_decode_matches_accumulate(name: str, offset: int) -> None:
    """Float32 outputs of 4 MiB and more are written with non-temporal stores (elements.h,
    Output::streaming) where they are 16-byte aligned: the values must not change."""
    compressor = COMPRESSORS[name]()
    numel = (1 << 20) + 333
    x, residual = make_input(numel, torch.float32, seed=3)
    payload = compressor.encode(x, residual)
    storage = torch.full((numel + 1,), float("nan"))
    out = storage[offset:offset + numel]
    compressor.decode(payload, out=out, numel=numel)
    assert torch.equal(out, compressor.decode_accumulate(payload, torch.zeros(numel)))
    assert torch.equal(out[: numel // 2], compressor.decode(payload)[: numel // 2])
