"""Compressed all-reduce with error feedback, on any process group.

On a ddlcomm group the native implementation runs (``ProcessGroupDdlcomm.compressed_allreduce``).
On gloo or nccl groups the same algorithm runs over standard collectives
(``all_to_all_single`` and ``all_gather_into_tensor`` of the packed payloads), with the
same kernels, the same randomness streams and the same summation order. So both give
bitwise the same result.

Quantizers and casts (1-bit, ternary, fp16, bf16) use scatter-reduce-gather with two
levels of error feedback, in segments of 16 Mi elements (so that the native
implementation encodes one segment while the one before it is on the wire). In each
segment every rank encodes its part in n chunks with its worker residual; rank i decodes
and sums chunk i from every rank in rank order, re-encodes the sum with its server
residual; an all-gather of those payloads gives every rank the same bytes. Sparse formats
(top-k, random-k) all-gather the (index, value) payloads and sum them in rank order.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from . import _C
from .compress import Compressor, all_finite

__all__ = ["compressed_all_reduce", "server_residual_numel", "native_backend", "wire_bytes"]

_SPARSE = {"top_k", "random_k"}
_encode_stream = _C.ProcessGroupDdlcomm.encode_stream


def native_backend(group: Optional[dist.ProcessGroup]) -> Optional[_C.ProcessGroupDdlcomm]:
    """The ddlcomm backend behind `group` (default: the world), or None for other backends."""
    group = group or dist.group.WORLD
    try:
        backend = group._get_backend(torch.device("cpu"))
    except RuntimeError:
        return None
    return backend if isinstance(backend, _C.ProcessGroupDdlcomm) else None


def _chunk_bounds(numel: int, n: int) -> list[int]:
    # Same split as the native ring::Chunks: chunk i is [numel*i//n, numel*(i+1)//n).
    return [numel * i // n for i in range(n + 1)]


def _segments(numel: int, n: int) -> list[tuple[int, int, list[int]]]:
    # Same split as the native compressed all-reduce: (begin, end, chunk bounds relative to
    # begin) of each segment.
    step = _C.ProcessGroupDdlcomm.segment_elements
    return [
        (begin, min(begin + step, numel), _chunk_bounds(min(step, numel - begin), n))
        for begin in range(0, numel, step)
    ]


def server_residual_numel(numel: int, rank: int, world_size: int) -> int:
    """Length of the server residual of `rank`: its chunk of every segment of the vector."""
    return sum(bounds[rank + 1] - bounds[rank] for _, _, bounds in _segments(numel, world_size))


def wire_bytes(compressor: Compressor, numel: int, world_size: int, rank: int = 0) -> int:
    """Bytes `rank` sends for one compressed all-reduce of `numel` elements."""
    n = world_size
    if n == 1:
        return 0
    if compressor.format in _SPARSE:
        return (n - 1) * compressor.compressed_nbytes(numel)
    total = 0
    for _, _, bounds in _segments(numel, n):
        chunk_bytes = [compressor.compressed_nbytes(bounds[i + 1] - bounds[i]) for i in range(n)]
        # all-to-all of the worker payloads (all but its own chunk), then its server payload to every peer
        total += sum(chunk_bytes) - chunk_bytes[rank] + (n - 1) * chunk_bytes[rank]
    return total


def compressed_all_reduce(
    tensor: torch.Tensor,
    compressor: Compressor,
    worker_residual: Optional[torch.Tensor] = None,
    server_residual: Optional[torch.Tensor] = None,
    group: Optional[dist.ProcessGroup] = None,
    average: bool = True,
    stream: int = 0,
) -> torch.futures.Future:
    """All-reduces `tensor` in place through `compressor`; returns a Future of the tensor.

    Args:
        tensor: float32, float16 or bfloat16 CPU tensor; overwritten with the result.
        compressor: a ``ddlcomm.compress`` compressor.
        worker_residual: float32 tensor of ``tensor.numel()`` elements (error feedback of
            what this rank sent), updated in place; None disables worker error feedback.
        server_residual: float32 tensor of ``server_residual_numel(...)`` elements (error
            feedback of the chunk this rank reduces); unused by sparse formats.
        group: the process group (default: the world).
        average: divide the sum by the group size.
        stream: randomness stream of this call (e.g. the training step), so ternary and
            random-k draw fresh, reproducible randomness each call.
    """
    # Random-k sends a random sample, which can miss a non-finite entry; a non-finite gradient
    # anywhere must still make the result non-finite everywhere (GradScaler skips the step).
    poisoned = None
    if compressor.format == "random_k":
        poisoned = torch.tensor([0 if all_finite(tensor) else 1], dtype=torch.uint8)
        dist.all_reduce(poisoned, op=dist.ReduceOp.MAX, group=group)

    def finish(result: torch.Tensor) -> torch.Tensor:
        if poisoned is not None and poisoned.item():
            result.fill_(float("nan"))
        return result

    backend = native_backend(group)
    if backend is not None:
        work = backend.compressed_allreduce(
            tensor, compressor._config, worker_residual, server_residual, average, int(stream)
        )
        return work.get_future().then(lambda fut: finish(fut.value()[0]))
    _fallback(tensor, compressor, worker_residual, server_residual, group, average, int(stream))
    done: torch.futures.Future = torch.futures.Future()
    done.set_result(finish(tensor))
    return done


def _fallback(
    tensor: torch.Tensor,
    compressor: Compressor,
    worker_residual: Optional[torch.Tensor],
    server_residual: Optional[torch.Tensor],
    group: Optional[dist.ProcessGroup],
    average: bool,
    stream: int,
) -> None:
    """The native algorithm over standard collectives (gloo, nccl): same bytes, same sums."""
    group = group or dist.group.WORLD
    n, r = dist.get_world_size(group), dist.get_rank(group)
    flat = tensor.view(-1)
    numel = flat.numel()
    if numel == 0:
        return
    scale = 1.0 / n if average else 1.0
    if compressor.format in _SPARSE:
        payload = compressor.encode(flat, worker_residual, stream=_encode_stream(stream, r, 0, 0, n))
        everyone = torch.empty(n * payload.numel(), dtype=torch.uint8)
        dist.all_gather_into_tensor(everyone, payload, group=group)
        acc = torch.zeros(numel, dtype=torch.float32)
        for part in everyone.view(n, -1):
            compressor.decode_accumulate(part, acc)
        if average:
            acc.mul_(scale)
        flat.copy_(acc)
        return

    residual_at = 0
    for segment, (begin, end, bounds) in enumerate(_segments(numel, n)):
        mine = bounds[r + 1] - bounds[r]
        _scatter_reduce_gather(
            flat[begin:end],
            bounds,
            compressor,
            None if worker_residual is None else worker_residual[begin:end],
            None if server_residual is None else server_residual[residual_at : residual_at + mine],
            group,
            scale,
            stream,
            segment,
        )
        residual_at += mine


def _scatter_reduce_gather(
    flat: torch.Tensor,
    bounds: list[int],
    compressor: Compressor,
    worker_residual: Optional[torch.Tensor],
    server_residual: Optional[torch.Tensor],
    group: dist.ProcessGroup,
    scale: float,
    stream: int,
    segment: int,
) -> None:
    """One segment of a quantized or cast compressed all-reduce, in place; chunk i is
    flat[bounds[i]:bounds[i + 1]]."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    lengths = [bounds[i + 1] - bounds[i] for i in range(n)]
    payloads = [
        compressor.encode(
            flat[bounds[i] : bounds[i + 1]],
            None if worker_residual is None else worker_residual[bounds[i] : bounds[i + 1]],
            stream=_encode_stream(stream, r, 0, i, n, segment),
        )
        for i in range(n)
    ]
    mine = compressor.compressed_nbytes(lengths[r])
    incoming = torch.empty(n * mine, dtype=torch.uint8)
    dist.all_to_all_single(
        incoming, torch.cat(payloads), [mine] * n, [p.numel() for p in payloads], group=group
    )
    acc = torch.zeros(lengths[r], dtype=torch.float32)
    for part in incoming.view(n, mine):
        compressor.decode_accumulate(part, acc)
    if scale != 1.0:
        acc.mul_(scale)
    reduced = compressor.encode(acc, server_residual, stream=_encode_stream(stream, r, 1, r, n, segment))
    # all_gather_into_tensor needs equal sizes: chunk payloads differ by at most one element's worth.
    sizes = [compressor.compressed_nbytes(length) for length in lengths]
    widest = max(sizes)
    padded = torch.zeros(widest, dtype=torch.uint8)
    padded[: reduced.numel()] = reduced
    gathered = torch.empty(n * widest, dtype=torch.uint8)
    dist.all_gather_into_tensor(gathered, padded, group=group)
    for j, part in enumerate(gathered.view(n, widest)):
        compressor.decode(part[: sizes[j]], out=flat[bounds[j] : bounds[j + 1]])
