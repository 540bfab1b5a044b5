"""The soak's exact reference (tests/workers/soak.py): inputs that any rank regenerates from a
seed, reductions computed locally, and results compared bit for bit."""

from __future__ import annotations

import hashlib
from typing import Iterable, Optional

import torch


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bytes of `t` (NaN-safe, -0.0 != 0.0): results are compared bit for bit."""
    flat = t.reshape(-1)
    if flat.stride(0) != 1:  # strided, or a 0/1-element view that counts as contiguous yet keeps its stride
        flat = flat.clone(memory_format=torch.contiguous_format)
    return flat.view(torch.uint8)


def digest(t: torch.Tensor) -> int:
    return int.from_bytes(hashlib.blake2b(bits(t).numpy(), digest_size=8).digest(), "little", signed=True)


def integers(numel: int, dtype: torch.dtype, op: str, seed: int) -> torch.Tensor:
    """Small integers, as common.make_input draws them, so reductions over 4 ranks are exact in
    every dtype; drawn directly in `dtype` (make_input draws int64 first: 8 bytes an element
    would make a 64 MiB int8 input cost 512 MiB, several times per step and rank)."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, (numel,), dtype=dtype, generator=g)
    if op == "PRODUCT":  # |x| in {1, 2}: a product over 4 ranks stays within 16
        if dtype == torch.uint8:
            return torch.randint(1, 3, (numel,), dtype=dtype, generator=g)
        t = torch.randint(-1, 3, (numel,), dtype=dtype, generator=g)
        t[t <= 0] -= 1
        return t
    return torch.randint(0 if dtype == torch.uint8 else -4, 5, (numel,), dtype=dtype, generator=g)


def fold(tensors: Iterable[torch.Tensor], op: str, n: int) -> torch.Tensor:
    """Reduces tensors one by one (two live at a time, unlike stacking n of them)."""
    acc: Optional[torch.Tensor] = None
    for t in tensors:
        if acc is None:
            acc = t.clone()
        elif acc.dtype == torch.bool:
            fn = {"SUM": torch.logical_or, "MAX": torch.logical_or, "BOR": torch.logical_or,
                  "PRODUCT": torch.logical_and, "MIN": torch.logical_and, "BAND": torch.logical_and,
                  "BXOR": torch.logical_xor}[op]
            fn(acc, t, out=acc)
        else:
            fn = {"SUM": torch.add, "AVG": torch.add, "PRODUCT": torch.mul, "MIN": torch.minimum,
                  "MAX": torch.maximum, "BAND": torch.bitwise_and, "BOR": torch.bitwise_or,
                  "BXOR": torch.bitwise_xor}[op]
            fn(acc, t, out=acc)
    assert acc is not None
    if op == "AVG":
        acc.div_(n)  # the backend divides the sum by n too (allreduce.cc divideBy)
    return acc
