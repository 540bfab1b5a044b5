"""Compressors with error feedback (ddlcomm.compressors, csrc/compress/): the error-feedback identity,
sizes and decode variants, non-finite input, determinism. The numpy contract and statistics are in
test_compress_contract.py, top-k selection in test_compress_topk.py."""

from __future__ import annotations

import pytest
import torch

from compress_cases import COMPRESSORS, DTYPES, SIZES, assert_error_feedback, make_input, sparse_entries
from ddlcomm.compressors import BF16, FP16, OneBit, RandomK, Ternary, TopK, inspect


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


def test_every_row_of_the_format_table_has_one_compressor_class() -> None:
    # The classes come from the C++ table (csrc/compress/formats.h): a row without a class, or two
    # classes on one row, would be a compressor users cannot reach or two names for one payload.
    from ddlcomm import _C
    from ddlcomm.compressors import Compressor

    def leaves(cls: type) -> list[type]:
        return [leaf for sub in cls.__subclasses__() for leaf in ([sub] if sub._format is not None else leaves(sub))]

    classes = [cls for cls in leaves(Compressor) if cls.__module__ == "ddlcomm.compressors"]
    assert sorted(cls().format for cls in classes) == sorted(row["name"] for row in _C.compress.formats)
    for row in _C.compress.formats:
        assert row["format"].name == row["name"].upper()


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
