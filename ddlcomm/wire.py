"""What the compressed paths share around torch's collectives: the check that every rank
reduces the same thing (``Agreement``), where a group's collectives run, the randomness stream
of a bucket's call and the uncompressed traffic the statistics compare with. The payloads
themselves move in C++ (``ddlcomm.compressed``)."""

from __future__ import annotations

import zlib

import torch
import torch.distributed as dist

from .compressors import Compressor

__all__ = ["COMPRESSIBLE_DTYPES", "Agreement", "aligned", "all_gather_single", "call_stream", "collectives_on_gpu",
           "ring_all_reduce_bytes", "ring_reduce_scatter_bytes"]

COMPRESSIBLE_DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# torch 2.13 renamed all_gather_into_tensor (and deprecated the old name).
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def aligned(nbytes: int) -> int:
    return (nbytes + 3) // 4 * 4


def call_stream(iteration: int, index: int) -> int:
    """The randomness stream of the compressed call of bucket (or module) `index` in training
    step `iteration`: fresh every step (ternary and random-k draw new randomness), distinct
    for the first 65536 buckets of a step. The DDP hooks and ddlcomm.fsdp number them alike."""
    return iteration * 65536 + index


def ring_all_reduce_bytes(nbytes: int, world_size: int) -> int:
    """Bytes each rank sends in a ring all-reduce of `nbytes`: the statistics' uncompressed
    baseline."""
    return 2 * (world_size - 1) * nbytes // max(world_size, 1)


def ring_reduce_scatter_bytes(nbytes: int, world_size: int) -> int:
    """Bytes each rank sends in a ring reduce-scatter of an `nbytes` input."""
    return (world_size - 1) * nbytes // max(world_size, 1)


def collectives_on_gpu(group: dist.ProcessGroup, device: torch.device) -> bool:
    """Whether `group` runs collectives of tensors on `device` on that GPU (NCCL does; gloo and
    ddlcomm stage them through the CPU)."""
    try:
        backend = group._get_backend(device)
    except RuntimeError:
        return False
    return "nccl" in type(getattr(backend, "wrapped_pg", backend)).__name__.lower()


class Agreement:
    """Every rank must reduce as many elements, of one dtype, with one compressor: gloo would
    abort the process on mismatched payload sizes, and a ddlcomm group would fail in the
    exchange, which can end it.
    The check's all-gather starts before this rank encodes and is waited for before the first
    payload is sent, so its latency hides behind the encoding."""

    def __init__(self, flat: torch.Tensor, compressor: Compressor, group: dist.ProcessGroup, n: int,
                 verify: bool, device: torch.device) -> None:
        self._work = None
        if not verify:
            return
        dtype = COMPRESSIBLE_DTYPES.index(flat.dtype) if flat.dtype in COMPRESSIBLE_DTYPES else len(COMPRESSIBLE_DTYPES)  # the encoder refuses others
        self._mine = torch.tensor([flat.numel(), dtype, zlib.crc32(repr(compressor).encode())], dtype=torch.int64,
                                  device=device)
        self._everyone = torch.empty(n * 3, dtype=torch.int64, device=device)
        self._work = all_gather_single(self._everyone, self._mine, group=group, async_op=True)
        self._compressor, self._group, self._n = compressor, group, n

    def wait(self) -> None:
        if self._work is None:
            return
        self._work.wait()
        self._work = None
        rows = self._everyone.view(self._n, 3).tolist()
        if all(row == rows[0] for row in rows):
            return
        me = dist.get_rank(self._group)
        other = next(i for i, row in enumerate(rows) if row != rows[me])
        what = lambda row: f"{row[0]} {(COMPRESSIBLE_DTYPES + ['other'])[row[1]]} elements"  # noqa: E731
        raise ValueError(f"compressed_all_reduce: ranks disagree: rank {me} reduces {what(rows[me])} with "
                         f"{self._compressor!r}, rank {other} {what(rows[other])}"
                         + ("" if rows[other][2] == rows[me][2] else " with another compressor"))
