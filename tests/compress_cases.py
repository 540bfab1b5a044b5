"""Compressor configurations, inputs and payload-header helpers shared by the compressor tests."""

from __future__ import annotations

import struct

import torch

from ddlcomm.compressors import BF16, FP16, OneBit, RandomK, Ternary, TopK

HEADER = struct.Struct("<IBBBBIIQQ")  # csrc/compress/wire_format.h
MASK64 = (1 << 64) - 1
F32_EPS = float(torch.finfo(torch.float32).eps)
# Inputs of at least this many elements take the sampled path of approximate top-k (topk.cc).
APPROX_MIN_NUMEL = 8 * (1 << 15)

COMPRESSORS = {
    "one_bit": lambda: OneBit(),
    "one_bit_two_scales": lambda: OneBit(two_scales=True),
    "one_bit_block37": lambda: OneBit(block_size=37),
    "ternary": lambda: Ternary(),
    "ternary_block5": lambda: Ternary(block_size=5),
    "ternary_stochastic": lambda: Ternary(stochastic=True, seed=7),
    "ternary_stochastic_clip_block5": lambda: Ternary(block_size=5, stochastic=True, clip=1.5, seed=7),
    "top_k": lambda: TopK(ratio=0.05),
    "top_k_approx": lambda: TopK(ratio=0.05, approximate=True),
    "top_k_2bit": lambda: TopK(ratio=0.05, value_bits=2),
    "top_k_8bit": lambda: TopK(k=37, value_bits=8),
    "random_k": lambda: RandomK(ratio=0.1, seed=3),
    "random_k_scaled": lambda: RandomK(k=5, seed=3, scaled=True),
    "fp16": lambda: FP16(),
    "bf16": lambda: BF16(),
}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SIZES = [0, 1, 5, 13, 255, 257, 1000, 4099]


def make_input(numel: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=gen).to(dtype)
    residual = 0.1 * torch.randn(numel, generator=gen)
    return x, residual


def header(payload: torch.Tensor) -> dict:
    magic, version, fmt, flags, res0, block, value_bits, numel, k = HEADER.unpack(bytes(payload[:32].tolist()))
    return dict(magic=magic, version=version, format=fmt, flags=flags, reserved0=res0, block_size=block,
                value_bits=value_bits, numel=numel, k=k)


def with_header(payload: torch.Tensor, **fields: int) -> torch.Tensor:
    values = header(payload) | fields
    out = payload.clone()
    out[:32] = torch.tensor(list(HEADER.pack(*values.values())), dtype=torch.uint8)
    return out


def section(payload: torch.Tensor, offset: int, count: int, dtype: torch.dtype) -> torch.Tensor:
    size = torch.empty(0, dtype=dtype).element_size()
    return payload[32 + offset:32 + offset + count * size].clone().view(dtype)


def sparse_entries(payload: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices and values of a top-k / random-k payload; value codes are looked up in their table."""
    h = header(payload)
    k, bits = h["k"], h["value_bits"]
    indices = section(payload, 0, k, torch.int32).long()
    if bits == 0:
        return indices, section(payload, 4 * k, k, torch.float32)
    return indices, section(payload, 4 * k, 1 << bits, torch.float32)[value_codes(payload)]


def value_codes(payload: torch.Tensor) -> torch.Tensor:
    """The b-bit codes of a top-k payload with value codes (wire_format.h), one int64 per entry."""
    h = header(payload)
    k, bits = h["k"], h["value_bits"]
    packed = payload[32 + 4 * k + (4 << bits):].long()
    shifts = torch.arange(0, 8, bits)
    codes = (packed[:, None] >> shifts) & ((1 << bits) - 1)
    return codes.reshape(-1)[:k]


def assert_error_feedback(y: torch.Tensor, decoded: torch.Tensor, residual: torch.Tensor) -> None:
    """decoded + residual == y up to the two float32 roundings of residual = y - decoded."""
    err = (decoded + residual - y).abs()
    tol = 2 * F32_EPS * (y.abs() + decoded.abs()) + 1e-30
    assert torch.all(err <= tol), f"max error {err.max().item()} (tolerance {tol[err.argmax()].item()})"
