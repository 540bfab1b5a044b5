"""8-bit parameter all-gathers for FSDP2 (ZeRO++'s qwZ): ``quantize_all_gather`` makes every
``fully_shard`` module of a model all-gather its parameters as int8 values with a float32
scale per block, and every rank computes with the decoded parameters. ``ddlcomm.fsdp``
re-exports ``AllGatherQuantization`` and ``quantize_all_gather``.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather

from .options import CompressionStats, LogOnce
from .wire import COMPRESSIBLE_DTYPES, aligned, all_gather_single

__all__ = ["quantized_nbytes", "quantize", "dequantize", "AllGatherQuantization", "QuantizedAllGather",
           "quantize_all_gather"]

logger = logging.getLogger(__name__)


def quantized_nbytes(numel: int, block_size: int) -> int:
    """Bytes of one rank's 8-bit payload: a float32 scale per block, then the int8 values."""
    blocks = -(-numel // block_size)
    return blocks * (4 + block_size)


def quantize(x: torch.Tensor, block_size: int, out: torch.Tensor) -> None:
    """Writes ``x`` (1-D float) into ``out`` (uint8, ``quantized_nbytes``): per block of
    ``block_size`` elements, scale = max |x| / 127 and q = round(x / scale). The last block is
    zero-padded. A non-finite element makes its whole block NaN after decoding."""
    blocks = -(-x.numel() // block_size)
    padded = torch.empty(blocks * block_size, dtype=torch.float32, device=x.device)
    padded[:x.numel()] = x
    padded[x.numel():] = 0
    padded = padded.view(blocks, block_size)
    scales = padded.abs().amax(dim=1).div_(127.0)
    inverse = torch.where(scales > 0, scales.reciprocal(), torch.zeros_like(scales))
    q = padded.mul_(inverse.unsqueeze(1)).round_().clamp_(-127, 127).to(torch.int8)
    out[:blocks * 4].view(torch.float32).copy_(scales)
    out[blocks * 4:].view(torch.int8).view(blocks, block_size).copy_(q)


def dequantize(payload: torch.Tensor, numel: int, block_size: int, out: torch.Tensor) -> None:
    """The inverse of ``quantize``: ``out`` (1-D, ``numel`` elements, any float dtype)."""
    blocks = -(-numel // block_size)
    scales = payload[:blocks * 4].view(torch.float32)
    q = payload[blocks * 4:].view(torch.int8).view(blocks, block_size)
    full = numel // block_size  # written in place, in one pass (a temporary would cost a second pass and an allocation)
    torch.mul(q[:full], scales[:full].unsqueeze(1), out=out[:full * block_size].view(full, block_size))
    if full < blocks:
        out[full * block_size:].copy_(q[full, :numel - full * block_size].to(torch.float32) * scales[full])


class AllGatherQuantization(LogOnce):
    """Options and statistics of the 8-bit parameter all-gathers of one model (made by
    ``quantize_all_gather``; one per rank).

    Attributes:
        block_size: elements per float32 scale.
        min_bytes: all-gathers whose input (one rank's shard) is smaller go unquantized.
        stats: bytes this rank sent, against an uncompressed ring all-gather.
    """

    _logger = logger

    def __init__(self, block_size: int = 64, min_bytes: int = 64 * 1024) -> None:
        if not isinstance(block_size, int) or not 1 <= block_size <= 1 << 20:
            raise ValueError(f"block_size must be an int in [1, 2^20], got {block_size!r}")
        if not isinstance(min_bytes, int) or min_bytes < 0:
            raise ValueError(f"min_bytes must be a non-negative int, got {min_bytes!r}")
        super().__init__()
        self.block_size = block_size
        self.min_bytes = min_bytes
        self.stats = CompressionStats()

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup) -> None:
        """``output`` = every rank's ``input`` in rank order, each through the 8-bit code; every
        rank decodes the same bytes, so every rank gets the same parameters, its own shard
        included."""
        n = group.size()
        m = input.numel()
        if output.numel() != n * m:
            raise ValueError(f"ddlcomm fsdp: all-gather output of {output.numel()} elements for an input of {m} on "
                             f"{n} ranks")
        ring = (n - 1) * m * input.element_size()
        reason = None
        if input.dtype not in COMPRESSIBLE_DTYPES:
            reason = "dtype"
            self.log_once("dtype", "ddlcomm fsdp: %s parameter all-gathers are not quantized (parameters of mixed "
                        "dtypes are gathered as bytes); float32, float16 and bfloat16 are", input.dtype)
        elif m * input.element_size() < self.min_bytes:
            reason = "small"
            self.log_once("small", "ddlcomm fsdp: parameter shards smaller than min_bytes=%d are all-gathered "
                        "unquantized (one had %d bytes)", self.min_bytes, m * input.element_size())
        if reason is not None:
            self.stats.count(ring, ring, compressed=False)
            all_gather_single(output, input, group=group)
            return
        slot = aligned(quantized_nbytes(m, self.block_size))
        mine = torch.zeros(slot, dtype=torch.uint8, device=input.device)
        quantize(input.reshape(-1), self.block_size, mine)  # before ``output`` (which holds ``input``) changes
        gathered = torch.empty(n * slot, dtype=torch.uint8, device=input.device)
        all_gather_single(gathered, mine, group=group)
        rows = output.view(n, m)
        for i in range(n):
            dequantize(gathered[i * slot:(i + 1) * slot], m, self.block_size, rows[i])
        self.stats.count((n - 1) * quantized_nbytes(m, self.block_size), ring, compressed=True)


class QuantizedAllGather(AllGather):
    """The parameter all-gather of one FSDP module (``FSDPModule.set_custom_all_gather``)."""

    def __init__(self, state: AllGatherQuantization) -> None:
        self.state = state

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False) -> None:
        self.state.all_gather(output_tensor, input_tensor, group)  # complete on return, like the reduce-scatter


def quantize_all_gather(model: torch.nn.Module, *, block_size: int = 64,
                        min_bytes: int = 64 * 1024) -> AllGatherQuantization:
    """All-gathers the parameters of every ``fully_shard`` module of ``model`` in 8 bits
    (ZeRO++'s qwZ): each rank sends its shard as int8 values with a float32 scale per
    ``block_size`` elements (64: 1.06 bytes per parameter, against 4 for float32 and 2 for
    bfloat16) and every rank computes with the decoded parameters, its own shard's included.
    The sharded parameters, which the optimizer updates, stay in full precision, so the error
    does not build up: each step's parameters are within max|block| / 254 of the exact ones.
    Call it after ``fully_shard``; combine it with ``compress_gradients`` for the
    reduce-scatters. Returns the options and statistics.
    """
    state = AllGatherQuantization(block_size, min_bytes)
    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not modules:
        raise ValueError("quantize_all_gather: the model has no fully_shard module; call fully_shard first")
    for module in modules:
        module.set_custom_all_gather(QuantizedAllGather(state))
    return state
