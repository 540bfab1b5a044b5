"""How every compressed path moves payloads over torch's collectives: where they travel (with
the tensor, or staged through pinned host memory), the check that every rank reduces the same
thing, and decoding what arrived. Used by ``ddlcomm.compressed`` (all-reduce, on any group),
``ddlcomm.fsdp`` (reduce-scatter) and the benchmarks; the native ddlcomm backend does the
same in C++."""

from __future__ import annotations

import zlib
from typing import Optional

import torch
import torch.distributed as dist

from .compressors import Compressor

__all__ = ["COMPRESSIBLE_DTYPES", "Agreement", "Wire", "accumulate", "aligned", "all_gather_single", "call_stream",
           "collectives_on_gpu", "decode", "ring_all_reduce_bytes", "ring_reduce_scatter_bytes"]

COMPRESSIBLE_DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# torch 2.13 renamed all_gather_into_tensor (and deprecated the old name).
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class Wire:
    """Where the payloads of one compressed all-reduce travel: with the tensor when the group's
    collectives run there (CPU tensors; CUDA tensors over NCCL), else through pinned host memory
    (CUDA tensors over gloo or ddlcomm, whose collectives run on the CPU)."""

    def __init__(self, tensor: torch.Tensor, group: Optional[dist.ProcessGroup]) -> None:
        self.gpu = tensor.device if tensor.is_cuda else None
        self.staged = self.gpu is not None and not collectives_on_gpu(group or dist.group.WORLD, tensor.device)
        self.device = torch.device("cpu") if self.staged else tensor.device

    def send(self, payload: torch.Tensor) -> torch.Tensor:
        """``payload`` where the collective can send it: a pinned host copy when staged, made on
        the current stream and waited for through an event."""
        if not self.staged:
            return payload
        host = torch.empty(payload.shape, dtype=payload.dtype, pin_memory=True)
        host.copy_(payload, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        copied.synchronize()
        return host

    def receive(self, payloads: torch.Tensor, compressor: Compressor, numels: list[int]) -> torch.Tensor:
        """Rows of payloads that arrived, on the tensor's device: staged ones are validated on
        the host first (row i carries numels[i] elements; its first nbytes(i) bytes are the
        payload), then copied to the GPU on the current stream."""
        if not self.staged:
            return payloads
        for row, numel in zip(payloads, numels):
            compressor._check_received(row[: compressor.compressed_nbytes(numel)], numel)
        return payloads.to(self.gpu, non_blocking=True)

    def empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device, pin_memory=self.staged)


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


def accumulate(compressor: Compressor, payloads: torch.Tensor, acc: torch.Tensor, numel: int) -> None:
    """acc += decode(row) for each row of payloads (of numel elements each), in row order."""
    nbytes = compressor.compressed_nbytes(numel)
    for part in payloads:
        if acc.is_cuda:
            compressor._decode_device(part[:nbytes], acc, accumulate=True)
        else:
            compressor.decode_accumulate(part[:nbytes], acc)


def decode(compressor: Compressor, payload: torch.Tensor, out: torch.Tensor) -> None:
    if out.is_cuda:
        compressor._decode_device(payload, out, accumulate=False)
    else:
        compressor.decode(payload, out=out)


class Agreement:
    """Every rank must reduce as many elements, of one dtype, with one compressor: gloo would
    abort the process on mismatched payload sizes (the native backend checks this itself).
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
