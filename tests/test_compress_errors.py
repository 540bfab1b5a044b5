"""Compressors refuse corrupt payloads and bad arguments with clear errors (ddlcomm.compressors)."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from compress_cases import COMPRESSORS, DTYPES, header, make_input, section, with_header
from ddlcomm.compressors import BF16, FP16, Compressor, OneBit, RandomK, Ternary, TopK, all_finite, inspect


# ---- corrupt payloads -----------------------------------------------------------------------------


def small_payload(name: str, numel: int = 37) -> tuple[Compressor, torch.Tensor]:
    compressor = COMPRESSORS[name]()
    x, residual = make_input(numel, torch.float32)
    return compressor, compressor.encode(x, residual)


def assert_rejected(compressor: Compressor, payload: torch.Tensor, numel: int = 37) -> None:
    with pytest.raises(ValueError):
        inspect(payload)
    with pytest.raises(ValueError):
        compressor.decode(payload, out=torch.zeros(numel))
    with pytest.raises(ValueError):
        compressor.decode_accumulate(payload, torch.zeros(numel))


@pytest.mark.parametrize("name", COMPRESSORS)
def test_truncated_or_extended_payload_is_rejected(name: str) -> None:
    compressor, payload = small_payload(name)
    for length in range(payload.numel()):
        with pytest.raises(ValueError):
            inspect(payload[:length].clone())
    assert_rejected(compressor, payload[:-1].clone())
    assert_rejected(compressor, torch.cat([payload, torch.zeros(1, dtype=torch.uint8)]))


@pytest.mark.parametrize("name", COMPRESSORS)
def test_corrupt_header_is_rejected(name: str) -> None:
    compressor, payload = small_payload(name)
    h = header(payload)
    corruptions = [
        dict(magic=h["magic"] ^ 1), dict(version=0), dict(version=2), dict(format=0), dict(format=7),
        dict(format=255), dict(flags=h["flags"] | 4), dict(flags=h["flags"] ^ 1), dict(reserved0=1),
        dict(value_bits=1), dict(block_size=1), dict(k=h["k"] + 1), dict(k=2**64 - 1),
    ]
    if h["block_size"]:
        corruptions += [dict(block_size=0), dict(numel=2**62), dict(numel=2**64 - 1)]
    if h["format"] != 2:  # only ternary payloads may say "stochastic"
        corruptions.append(dict(flags=h["flags"] | 2))
    for fields in corruptions:
        assert_rejected(compressor, with_header(payload, **fields))
    # A different element count can still describe a valid payload (e.g. the sign bits of 36 or 38
    # elements fill as many bytes as those of 37): decode rejects it against the caller's numel.
    for numel in (h["numel"] - 1, h["numel"] + 1, 2**62, 2**64 - 1):
        with pytest.raises(ValueError):
            compressor.decode(with_header(payload, numel=numel), out=torch.zeros(37))


def test_wrong_format_or_size_is_rejected_on_decode() -> None:
    x, _ = make_input(37, torch.float32)
    payload = FP16().encode(x)
    assert inspect(with_header(payload, format=6))["format"] == "bfloat16"
    with pytest.raises(ValueError, match="format"):
        FP16().decode(with_header(payload, format=6))
    with pytest.raises(ValueError, match="format"):
        OneBit().decode(payload)
    with pytest.raises(ValueError, match="elements"):
        FP16().decode(payload, out=torch.zeros(36))
    with pytest.raises(ValueError, match="elements"):
        FP16().decode(payload, numel=38)
    with pytest.raises(ValueError, match="elements"):
        FP16().decode_accumulate(payload, torch.zeros(38))


@pytest.mark.parametrize("name", ["top_k", "random_k"])
def test_bad_sparse_indices_are_rejected(name: str) -> None:
    compressor, payload = small_payload(name, numel=200)
    k = header(payload)["k"]
    assert k >= 3
    for position, index in [(k - 1, 200), (0, 2**32 - 1)]:
        bad = payload.clone()
        bad[32 + 4 * position:36 + 4 * position] = torch.tensor([index], dtype=torch.int64).view(torch.uint8)[:4]
        assert_rejected(compressor, bad, 200)
    indices = section(payload, 0, k, torch.int32)
    for order in (indices.flip(0), torch.cat([indices[:1], indices[:-1]])):  # decreasing, repeated
        bad = payload.clone()
        bad[32:32 + 4 * k] = order.view(torch.uint8)
        assert_rejected(compressor, bad, 200)


def test_invalid_ternary_code_and_unused_bits_are_rejected() -> None:
    compressor, payload = small_payload("ternary")  # 37 elements: 1 scale, 10 code bytes
    for position in (0, 17, 36):
        bad = payload.clone()
        byte = 32 + 4 + position // 4
        bad[byte] |= 3 << (2 * (position % 4))
        assert_rejected(compressor, bad)
    bad = payload.clone()
    bad[-1] |= 0x04  # element 37 does not exist
    assert_rejected(compressor, bad)


def test_unused_sign_bits_are_rejected() -> None:
    compressor, payload = small_payload("one_bit")  # 37 elements: the last byte uses 5 bits
    bad = payload.clone()
    bad[-1] |= 0x80
    assert_rejected(compressor, bad)


@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(sorted(COMPRESSORS)), flips=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 7)),
                                                                  min_size=1, max_size=4))
def test_random_bit_flips_are_rejected_or_decode_safely(name: str, flips: list[tuple[int, int]]) -> None:
    compressor, payload = small_payload(name)
    for position, bit in flips:
        payload[position % payload.numel()] ^= 1 << bit
    try:
        info = inspect(payload)
    except ValueError:
        return
    if info["format"] != compressor.format:
        with pytest.raises(ValueError, match="format"):
            compressor.decode(payload)
        return
    out = torch.zeros(37)
    if info["numel"] != 37:  # e.g. a sparse payload with another numel: valid, but not for this caller
        with pytest.raises(ValueError, match="elements"):
            compressor.decode_accumulate(payload, out)
        return
    compressor.decode_accumulate(payload, out)
    assert torch.equal(compressor.decode(payload), out)


# ---- API errors -------------------------------------------------------------------------------------


def test_invalid_arguments_raise_clear_errors() -> None:
    x, residual = make_input(64, torch.float32)
    compressor = OneBit()
    with pytest.raises(TypeError, match="float32"):
        compressor.encode(x.double())
    with pytest.raises(TypeError, match="float32"):
        compressor.encode(torch.arange(64))
    with pytest.raises(ValueError, match="CPU"):
        compressor.encode(torch.empty(64, device="meta"))
    with pytest.raises(ValueError, match="contiguous"):
        compressor.encode(x[::2])
    with pytest.raises(ValueError, match="contiguous"):
        compressor.encode(x.view(8, 8), residual.view(8, 8).t())
    with pytest.raises(TypeError, match="float32"):
        compressor.encode(x, residual.half())
    with pytest.raises(ValueError, match="elements"):
        compressor.encode(x, residual[:63])
    with pytest.raises(ValueError, match="stream"):
        compressor.encode(x, stream=-1)
    payload = compressor.encode(x)
    with pytest.raises(TypeError, match="uint8"):
        compressor.decode(payload.view(torch.int8))
    with pytest.raises(TypeError, match="float32"):
        compressor.decode_accumulate(payload, torch.zeros(64, dtype=torch.float16))
    with pytest.raises(TypeError):
        compressor.decode(payload, dtype=torch.float64)
    with pytest.raises(ValueError, match="contiguous"):
        compressor.decode(payload, out=torch.zeros(128)[::2])
    for bad in (lambda: OneBit(block_size=0), lambda: Ternary(clip=-1.0), lambda: TopK(ratio=0.0),
                lambda: TopK(ratio=1.5), lambda: RandomK(k=0)):
        with pytest.raises(ValueError):
            bad()


def test_wrong_argument_types_raise_plain_type_errors() -> None:
    """Each mistake is named in plain words, not with the native function's signature."""
    compressor = OneBit()
    x, residual = make_input(64, torch.float32)
    payload = compressor.encode(x)
    mistakes = {
        "stream must be an integer, got float 1.5": lambda: compressor.encode(x, stream=1.5),
        "stream must be an integer, got str '3'": lambda: compressor.encode(x, stream="3"),
        "stream must be an integer, got NoneType": lambda: compressor.encode(x, stream=None),
        "ratio must be a number in (0, 1], got str '0.1'": lambda: TopK(ratio="0.1"),
        "tensor must be a torch.Tensor, got list": lambda: compressor.encode([1.0, 2.0]),
        "tensor must be torch.float32, torch.float16 or torch.bfloat16, got torch.int64":
            lambda: compressor.encode(torch.arange(4)),
        "residual must be a torch.Tensor, got ndarray": lambda: compressor.encode(x, residual.numpy()),
        "residual must be a torch.float32 tensor, got torch.float64": lambda: compressor.encode(x, residual.double()),
        "out must be a torch.Tensor, got bytearray": lambda: compressor.encode(x, out=bytearray(100)),
        "payload must be a torch.Tensor, got bytes": lambda: compressor.decode(bytes(payload.tolist())),
        "numel must be an integer, got float 64.0": lambda: compressor.decode(payload, numel=64.0),
        "dtype must be torch.float32, torch.float16 or torch.bfloat16, got 'float32'":
            lambda: compressor.decode(payload, dtype="float32"),
        "dtype=torch.float16 but out is torch.float32": lambda: compressor.decode(payload, torch.zeros(64),
                                                                                  dtype=torch.float16),
        "out must be a torch.float32 tensor, got torch.bfloat16":
            lambda: compressor.decode_accumulate(payload, torch.zeros(64, dtype=torch.bfloat16)),
        "numel must be an integer, got float 10.0": lambda: compressor.compressed_nbytes(10.0),
        "block_size must be an integer, got float 256.0": lambda: OneBit(block_size=256.0),
        "seed must be an integer, got float 1.5": lambda: RandomK(seed=1.5),
        "k must be an integer, got bool True": lambda: TopK(k=True),
    }
    out_of_range = {
        "stream must be an integer in [0, 2**64), got -1": lambda: compressor.encode(x, stream=-1),
        "seed must be an integer in [0, 2**64), got -1": lambda: RandomK(seed=-1),
        "numel must be an integer in [0, 2**63), got -1": lambda: TopK().kept_entries(-1),
    }
    for error_type, cases in ((TypeError, mistakes), (ValueError, out_of_range)):
        for message, call in cases.items():
            with pytest.raises(error_type) as error:
                call()
            assert str(error.value).startswith(message), (message, str(error.value))
    # Integers of other types than int are integers.
    assert torch.equal(compressor.encode(x, stream=np.uint64(2**64 - 1)), compressor.encode(x, stream=2**64 - 1))
    assert torch.equal(compressor.decode(payload, numel=torch.tensor(64)), compressor.decode(payload))


def test_options_that_a_compressor_would_ignore_are_refused() -> None:
    for cls in (TopK, RandomK):
        with pytest.raises(ValueError, match="ratio or k, not both"):
            cls(ratio=0.1, k=3)
        assert cls().kept_entries(1000) == 10 and cls(k=3).kept_entries(1000) == 3
        assert cls(ratio=0.2).kept_entries(1000) == 200
        assert cls() == cls(ratio=0.01)  # the default is the stated one
    for cls in (FP16, BF16):
        with pytest.raises(TypeError, match="block_size"):
            cls(block_size=128)
    with pytest.raises(TypeError, match="base class"):
        Compressor()


def test_star_import_binds_only_public_names() -> None:
    """`from ddlcomm.compressors import *` used to bind the module's imports and shadow the standard
    library's inspect module with ddlcomm's inspect()."""
    import ddlcomm.compressors

    namespace: dict = {}
    exec("from ddlcomm.compressors import *", namespace)
    names = set(namespace) - {"__builtins__"}
    assert names == set(ddlcomm.compressors.__all__)
    assert "inspect" not in names and not any(name.startswith("_") for name in names)
    assert all(getattr(ddlcomm.compressors, name).__module__ == "ddlcomm.compressors" for name in names)


def test_invalid_thread_count_is_refused_naming_the_variable(monkeypatch) -> None:
    x, _ = make_input(64, torch.float32)
    for value in ("0", "-2", "four", "3 "):
        monkeypatch.setenv("DDLCOMM_NUM_THREADS", value)
        with pytest.raises(ValueError, match=f"DDLCOMM_NUM_THREADS='{value}' is invalid: expected an integer from 1"):
            OneBit().encode(x)


@pytest.mark.parametrize("name", COMPRESSORS)
def test_pickled_compressor_encodes_the_same(name: str) -> None:
    """torch.save of a hook state pickles its compressor: the copy has the same options and
    writes the same payload and residual."""
    original = COMPRESSORS[name]()
    copy = pickle.loads(pickle.dumps(original))
    assert copy == original and repr(copy) == repr(original) and hash(copy) == hash(original)
    assert copy != TopK(ratio=0.5)  # no compressor above keeps half
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    r1, r2 = torch.zeros(1000), torch.zeros(1000)
    assert torch.equal(original.encode(x, r1, stream=2), copy.encode(x, r2, stream=2))
    assert torch.equal(r1, r2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_all_finite_agrees_with_isfinite(dtype: torch.dtype) -> None:
    big = torch.finfo(dtype).max
    cases = [torch.zeros(0), torch.randn(1000), torch.full((1000,), big), torch.tensor([big, -big, big])]
    for bad in (float("inf"), float("-inf"), float("nan")):
        for at in (0, 500, 999):
            x = torch.randn(1000)
            x[at] = bad
            cases.append(x)
    both = torch.randn(1000)
    both[3], both[7] = float("inf"), float("-inf")  # sum NaN
    cases.append(both)
    for x in cases:
        x = x.to(dtype)
        assert all_finite(x) == bool(torch.isfinite(x).all()), x


def test_compressed_all_reduce_before_init_process_group_says_so() -> None:
    from ddlcomm.compressed import compressed_all_reduce

    with pytest.raises(ValueError, match="init_process_group first"):
        compressed_all_reduce(torch.ones(4), OneBit())


def test_compressed_all_reduce_refuses_what_is_not_a_tensor_and_a_compressor() -> None:
    from ddlcomm.compressed import compressed_all_reduce

    with pytest.raises(TypeError, match="got Tensor and str"):
        compressed_all_reduce(torch.ones(4), "one_bit")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="got list and OneBit"):
        compressed_all_reduce([1.0, 2.0], OneBit())  # type: ignore[arg-type]
