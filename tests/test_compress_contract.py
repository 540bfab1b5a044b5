"""The compressors' cross-device contract, recomputed in numpy (scales, codes and indices bit for
bit), and the statistics of the stochastic ones (ddlcomm.compressors, csrc/compress/)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from compress_cases import DTYPES, MASK64, make_input, section, sparse_entries
from ddlcomm.compressors import Compressor, OneBit, RandomK, Ternary, inspect


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
