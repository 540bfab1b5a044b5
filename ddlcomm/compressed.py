"""Compressed all-reduce with error feedback, on any process group.

One implementation, in C++ (``csrc/collectives/compressed_allreduce.cc``), serves every group's
CPU tensors: a ddlcomm group runs it on its own transport, a group of another backend with CPU
collectives (gloo, a third party's) on that backend's send and recv (``engine_of``). A call
returns at once with a future; every rank ends with the same bits on either kind of group.
Over several hosts of as many ranks it takes two levels (where ``two_levels`` says): exact inside
each host, compressed across.

Quantizers and casts (1-bit, ternary, fp16, bf16) use scatter-reduce-gather with two
levels of error feedback, in pieces of 16 Mi elements (one piece is encoded while the one
before it is on the wire). In each piece every rank encodes its part in n chunks with its
worker residual; rank i decodes and sums chunk i from every rank in rank order, re-encodes the
sum with its server residual; an all-gather of those payloads gives every rank the same bytes.
Sparse formats (top-k, random-k) all-gather the (index, value) payloads and sum them in rank
order.

CUDA tensors still take the same algorithm over torch's collectives, in Python (``_fallback``):
encoded and decoded on their GPU, on the current stream. Over NCCL the payloads stay in device
memory. Over gloo and ddlcomm (whose collectives run on the CPU) only the payloads cross PCIe,
through pinned host memory: each copy is waited for by a CUDA event, never a device
synchronization, and what arrives is validated on the host before it goes back to the GPU. The
result is bitwise the same as on the CPU for the deterministic formats (the CUDA kernels are
bit-exact twins of the CPU ones).
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import functools
import logging
import os
from typing import Optional

import torch
import torch.distributed as dist

from . import _C
from .compressors import Compressor, all_finite
from .host_levels import HostLevels, host_levels
from .wire import Agreement, Wire, accumulate, aligned, all_gather_single, decode

__all__ = [
    "compressed_all_reduce", "engine_of", "start_compressed_all_reduce", "host_levels_of", "server_chunks",
    "server_residual_numel", "native_backend", "reduce_scatter_wire_bytes", "two_levels", "wire_bytes",
]

logger = logging.getLogger(__name__)

_encode_stream = _C.ProcessGroupDdlcomm.encode_stream


def native_backend(group: Optional[dist.ProcessGroup]) -> Optional[_C.ProcessGroupDdlcomm]:
    """The ddlcomm backend behind `group` (default: the world), or None for other backends."""
    group = group or dist.group.WORLD
    try:
        backend = group._get_backend(torch.device("cpu"))
    except RuntimeError:
        return None
    # TORCH_DISTRIBUTED_DEBUG=DETAIL wraps every backend in a checking ProcessGroupWrapper.
    backend = getattr(backend, "wrapped_pg", backend)
    if isinstance(backend, _C.ProcessGroupDdlcomm):
        return backend
    if dist.get_backend(group) == "ddlcomm":
        _log_python_path(group.group_name)
    return None


@functools.lru_cache(maxsize=None)
def _log_python_path(group_name: str) -> None:
    """Said once per group: a ddlcomm group whose backend cannot be reached runs its compressed
    collectives over its own send and recv, as a group of another backend."""
    logger.warning("ddlcomm: process group %s is a ddlcomm group but its backend is not reachable (wrapped by "
                   "another layer?); compressed collectives run over its send and recv, more slowly",
                   group_name)


_engines: dict[str, tuple[dist.ProcessGroup, _C.ProcessGroupDdlcomm]] = {}  # by group name


def engine_of(group: Optional[dist.ProcessGroup] = None) -> Optional[_C.ProcessGroupDdlcomm]:
    """What runs the compressed collectives of ``group``'s CPU tensors (default: the world).

    A ddlcomm group's own backend; on a group of another backend with CPU collectives (gloo, a
    third party's), a ddlcomm backend whose messages travel as that backend's send and recv
    (``ProcessGroupDdlcomm.over``), made at the group's first compressed call: that call is
    collective (every rank gives its host, in one all-gather). Its tags have bit 30 set: the
    user's own send and recv on the group keep tags below 2**30. It takes two levels over the
    group's hosts only under ``DDLCOMM_ALLREDUCE_ALGO=hierarchical``: over gloo the exact sums
    inside a host (TCP on loopback) cost more than they save. None where the group has no CPU
    backend (nccl only)."""
    group = group or dist.group.WORLD
    native = native_backend(group)
    if native is not None:
        return native
    cached = _engines.get(group.group_name)
    if cached is not None and cached[0] is group:
        return cached[1]
    try:
        carrier = group._get_backend(torch.device("cpu"))
    except RuntimeError:
        return None
    _forget_destroyed_groups()
    identities: list[Optional[str]] = [None] * dist.get_world_size(group)
    dist.all_gather_object(identities, _C.ProcessGroupDdlcomm.host_identity(), group=group)
    timeout = getattr(getattr(carrier, "options", None), "_timeout", None) or datetime.timedelta(minutes=30)
    forced = os.environ.get("DDLCOMM_ALLREDUCE_ALGO", "auto")
    engine = _C.ProcessGroupDdlcomm.over(carrier, identities, timeout, group.group_name,
                                         "hierarchical" if forced == "hierarchical" else "ring")
    _engines[group.group_name] = (group, engine)
    return engine


def _forget_destroyed_groups() -> None:
    """Drops the engines of destroyed groups: each holds its carrier's connections."""
    for name, (group, _) in list(_engines.items()):
        try:
            dist.get_process_group_ranks(group)
        except (KeyError, ValueError, RuntimeError):
            del _engines[name]


# Joined while the interpreter is whole, not in its teardown.
atexit.register(_engines.clear)


# The layout and the traffic come from the C++ plan the native algorithm runs (compressed_allreduce.h):
# the Python path cannot split differently, nor the statistics count differently.
_pieces = _C.ProcessGroupDdlcomm.compressed_allreduce_pieces  # (numel, n): [(begin, end, chunk bounds)]


def server_chunks(numel: int, rank: int, world_size: int, group: Optional[dist.ProcessGroup] = None,
                  compressor: Optional[Compressor] = None, flat: bool = False) -> list[tuple[int, int]]:
    """The [begin, end) ranges of the vector that `rank` reduces (its chunk of every piece),
    in the order its server residual holds them. Given the compressor (`rank` must then be this
    rank): the plan that group runs, the hierarchical one where its hosts take it
    (docs/collectives.md; on a group of another backend, finding its hosts is collective the
    first time); without it, or with `flat` (a call that asked for one level), the flat plan."""
    if compressor is not None and not flat:
        engine = engine_of(group) if world_size > 1 else None
        if engine is not None:
            return [tuple(c) for c in engine.compressed_server_chunks(compressor.config, numel)]
        levels = host_levels_of(group or dist.group.WORLD) if world_size > 1 else None
        if levels is not None and not compressor.is_sparse:
            return [tuple(c) for c in levels.plan(numel)["server_chunks"]]
    return [(begin + bounds[rank], begin + bounds[rank + 1]) for begin, _, bounds in _pieces(numel, world_size)]


def host_levels_of(group: dist.ProcessGroup) -> Optional[HostLevels]:
    """The two levels the compressed collectives over standard collectives take on `group`, or
    None (a ddlcomm group's CUDA tensors by its own allreduce_algorithm); collective the first
    time on a group."""
    backend = native_backend(group)
    return host_levels(group, None if backend is None else backend.options.allreduce_algorithm, backend is not None)


def two_levels(group: Optional[dist.ProcessGroup] = None) -> bool:
    """Whether compressed all-reduces on `group` take two levels over its hosts (exact inside
    each, compressed across) unless a call passes ``flat=True``. On a ddlcomm group the answer
    comes after the collectives queued before it (ask once, not per call); on a group of another
    backend, collective the first time (``host_levels_of``)."""
    group = group or dist.group.WORLD
    if dist.get_world_size(group) == 1:
        return False
    engine = engine_of(group)
    if engine is not None:
        return engine.compressed_two_levels()
    return host_levels_of(group) is not None


def server_residual_numel(numel: int, rank: int, world_size: int) -> int:
    """Length of the server residual of `rank`: its chunk of every piece of the vector."""
    return _C.ProcessGroupDdlcomm.server_residual_numel(numel, rank, world_size)


def wire_bytes(compressor: Compressor, numel: int, world_size: int, rank: int = 0) -> int:
    """Bytes `rank` sends for one compressed all-reduce of `numel` elements."""
    return _C.ProcessGroupDdlcomm.compressed_allreduce_wire_bytes(compressor.config, numel, rank, world_size)


def reduce_scatter_wire_bytes(compressor: Compressor, numel: int, world_size: int) -> int:
    """Bytes each rank sends for one compressed reduce-scatter (``ddlcomm.fsdp``) of `numel`
    output elements."""
    return _C.ProcessGroupDdlcomm.compressed_reduce_scatter_wire_bytes(compressor.config, numel, world_size)


def compressed_all_reduce(
    tensor: torch.Tensor,
    compressor: Compressor,
    worker_residual: Optional[torch.Tensor] = None,
    server_residual: Optional[torch.Tensor] = None,
    group: Optional[dist.ProcessGroup] = None,
    average: bool = True,
    stream: int = 0,
    verify: bool = True,
    flat: bool = False,
) -> torch.futures.Future:
    """All-reduces `tensor` (CPU or CUDA) in place through `compressor`; returns a Future of the tensor.

    A communication failure raises from the Future's ``wait()`` as torch's ``Future.then``
    reports it: a RuntimeError quoting the ``DistBackendError``. To catch the
    ``DistBackendError`` itself, wait on the first future of ``start_compressed_all_reduce``.

    Args:
        tensor: float32, float16 or bfloat16 tensor, on the CPU or a GPU; overwritten
            with the result. Residuals live on the tensor's device.
        compressor: a ``ddlcomm.compressors`` compressor.
        worker_residual: float32 tensor of ``tensor.numel()`` elements (error feedback of
            what this rank sent), updated in place; None disables worker error feedback.
        server_residual: float32 tensor of ``server_residual_numel(...)`` elements (error
            feedback of the chunk this rank reduces); unused by sparse formats.
        group: the process group (default: the world).
        average: divide the sum by the group size.
        stream: randomness stream of this call (e.g. the training step), so ternary and
            random-k draw fresh, reproducible randomness each call.
        verify: on groups of other backends, first check that every rank reduces as many elements of one
            dtype with one compressor (one small all-gather; ValueError on every rank if not).
            Skip it only where the caller has checked that itself, as the DDP hooks do once
            per bucket. Unchecked calls are still refused, on the first message (which carries
            the call's signature) or the first payload (its compressor), but that failure ends
            the group's compressed collectives; ddlcomm groups always check, at no cost.
        flat: one level (every rank compresses for the whole group) where the group takes two
            over its hosts (``two_levels``); every rank must pass the same. The server
            residual's places differ between the two plans (``server_chunks``).
    """
    return start_compressed_all_reduce(tensor, compressor, worker_residual, server_residual, group, average, stream,
                                       verify, flat)[1]


def start_compressed_all_reduce(
    tensor: torch.Tensor,
    compressor: Compressor,
    worker_residual: Optional[torch.Tensor] = None,
    server_residual: Optional[torch.Tensor] = None,
    group: Optional[dist.ProcessGroup] = None,
    average: bool = True,
    stream: int = 0,
    verify: bool = True,
    flat: bool = False,
) -> tuple[torch.futures.Future, torch.futures.Future]:
    """``compressed_all_reduce``, returning (the communication's own future, the tensor's).

    Waiting on the first raises a failure as itself (``DistBackendError``); torch's
    ``Future.then``, which makes the second, would wrap it in a RuntimeError.
    """
    if not isinstance(tensor, torch.Tensor) or not isinstance(compressor, Compressor):
        raise TypeError(f"compressed_all_reduce takes a tensor and a ddlcomm.compressors compressor, got "
                        f"{type(tensor).__name__} and {type(compressor).__name__}")
    if group is None and not dist.is_initialized():  # as torch's collectives say it
        raise ValueError("compressed_all_reduce: the default process group has not been initialized: call "
                         "torch.distributed.init_process_group first")
    wire = Wire(tensor, group)
    # Random-k sends a random sample, which can miss a non-finite entry; a non-finite gradient
    # anywhere must still make the result non-finite everywhere (GradScaler skips the step),
    # and the residuals must not take it in.
    if compressor.samples_randomly:
        poisoned = torch.tensor([0 if all_finite(tensor) else 1], dtype=torch.uint8, device=wire.device)
        work = dist.all_reduce(poisoned, op=dist.ReduceOp.MAX, group=group, async_op=True)
        work.wait()
        if poisoned.item():
            return _completed(work.get_future(), tensor.fill_(float("nan")))

    engine = engine_of(group) if not tensor.is_cuda else None
    if engine is not None:
        if verify and engine is not native_backend(group):
            # A mismatch the engine finds in flight would leave it unusable: refused here, on every
            # rank, the group stays usable.
            Agreement(tensor, compressor, group or dist.group.WORLD, engine.size(), True, wire.device).wait()
        work = engine.compressed_allreduce(
            tensor, compressor.config, worker_residual, server_residual, average, int(stream), flat
        )
        raw = work.get_future()
        return raw, raw.then(lambda fut: fut.value()[0])
    _fallback(tensor, compressor, worker_residual, server_residual, group, average, int(stream), verify, wire, flat)
    done: torch.futures.Future = torch.futures.Future()
    done.set_result([tensor])
    return _completed(done, tensor)


def _completed(raw: torch.futures.Future, tensor: torch.Tensor) -> tuple[torch.futures.Future, torch.futures.Future]:
    done: torch.futures.Future = torch.futures.Future()
    done.set_result(tensor)
    return raw, done


def _fallback(
    tensor: torch.Tensor,
    compressor: Compressor,
    worker_residual: Optional[torch.Tensor],
    server_residual: Optional[torch.Tensor],
    group: Optional[dist.ProcessGroup],
    average: bool,
    stream: int,
    verify: bool,
    wire: Wire,
    one_level: bool,
) -> None:
    """The C++ algorithm over torch's collectives, for CUDA tensors (on any group): the same
    bytes and sums."""
    group = group or dist.group.WORLD
    n, r = dist.get_world_size(group), dist.get_rank(group)
    flat = tensor.view(-1)
    numel = flat.numel()
    levels = host_levels_of(group) if n > 1 and not one_level else None
    agreement = Agreement(flat, compressor, group, n, verify, wire.device)
    if numel == 0:
        agreement.wait()
        return
    scale = 1.0 / n if average else 1.0
    if levels is not None:
        agreement.wait()  # before the exact sum inside the host, which gloo cannot check
        _over_hosts(flat, worker_residual, server_residual, levels,
                    _Among(compressor, levels.across, scale, stream, None, wire, (r, n)))
        return
    among = _Among(compressor, group, scale, stream, agreement, wire, (r, n))
    if compressor.is_sparse:
        _sparse_among(flat, worker_residual, among)
    else:
        _pieces_among(flat, [(begin, bounds) for begin, _, bounds in _pieces(numel, n)], worker_residual,
                      server_residual, among)


@dataclasses.dataclass
class _Among:
    """What every part of one compressed all-reduce shares among the ranks it runs with.

    Attributes:
        compressor: the call's compressor.
        group: the ranks the part runs among (the call's group, or one rank per host).
        scale: the factor of the sum (1/n of the whole group to average).
        stream: the call's randomness stream.
        agreement: the check that every rank reduces the same, waited for before the first
            payload leaves (None: already waited for).
        wire: where the payloads travel.
        streams: the (rank, size) that number the encodes' randomness streams: the whole
            group's, also where ``group`` is one rank per host.
    """

    compressor: Compressor
    group: dist.ProcessGroup
    scale: float
    stream: int
    agreement: Optional[Agreement]
    wire: Wire
    streams: tuple[int, int]

    def checked(self) -> None:
        if self.agreement is not None:
            self.agreement.wait()


def _over_hosts(flat: torch.Tensor, worker_residual: Optional[torch.Tensor], server_residual: Optional[torch.Tensor],
                levels: HostLevels, among: _Among) -> None:
    """The native two-level plan over standard collectives: the exact sum inside the host (in
    the tensor's dtype, by the backend's own all-reduce), each rank's shard of it compressed
    `among` the ranks at its place on the other hosts (error feedback on that shard; the encode
    streams of the whole group's ranks), the shards all-gathered inside the host. Every rank
    decodes or copies the same bytes; the in-host sums may round otherwise than the native
    ring's."""
    plan = levels.plan(flat.numel())
    dist.all_reduce(flat, group=levels.host)
    if among.compressor.is_sparse:
        bounds = plan["sparse_shards"]
        begin, end = bounds[levels.local], bounds[levels.local + 1]
        _sparse_among(flat[begin:end], None if worker_residual is None else worker_residual[begin:end], among)
        _gather_in_host(flat, bounds, levels)
        return
    _pieces_among(flat, [(at, bounds) for _, _, _, at, bounds in plan["pieces"]], worker_residual, server_residual,
                  among)
    for begin, end, in_host, _, _ in plan["pieces"]:
        _gather_in_host(flat[begin:end], in_host, levels)


def _sparse_among(flat: torch.Tensor, worker_residual: Optional[torch.Tensor], among: _Among) -> None:
    """A sparse format's all-reduce, in place: every rank's payload all-gathered, decoded and
    summed in rank order."""
    compressor, wire = among.compressor, among.wire
    k, numel = dist.get_world_size(among.group), flat.numel()
    me, size = among.streams
    payload = wire.send(compressor.encode(flat, worker_residual, stream=_encode_stream(among.stream, me, 0, 0, size)))
    everyone = wire.empty(k * payload.numel())
    among.checked()
    all_gather_single(everyone, payload, group=among.group)
    acc = torch.zeros(numel, dtype=torch.float32, device=flat.device)
    accumulate(compressor, wire.receive(everyone.view(k, -1), compressor, [numel] * k), acc, numel)
    if among.scale != 1.0:
        acc.mul_(among.scale)
    flat.copy_(acc)


def _pieces_among(flat: torch.Tensor, spans: list[tuple[int, list[int]]], worker_residual: Optional[torch.Tensor],
                  server_residual: Optional[torch.Tensor], among: _Among) -> None:
    """The scatter-reduce-gather of every piece; spans: (the piece's begin in `flat`, its chunk
    bounds relative to it), one chunk per rank of ``among.group``."""
    me = dist.get_rank(among.group)
    residual_at = 0
    for piece, (begin, bounds) in enumerate(spans):
        mine = bounds[me + 1] - bounds[me]
        part = slice(begin, begin + bounds[-1])
        _scatter_reduce_gather(flat[part], bounds, None if worker_residual is None else worker_residual[part],
                               None if server_residual is None else server_residual[residual_at : residual_at + mine],
                               piece, among)
        residual_at += mine


def _gather_in_host(flat: torch.Tensor, bounds: list[int], levels: HostLevels) -> None:
    """Copies every host rank's shard flat[bounds[l]:bounds[l + 1]] to the others (all-gather
    needs equal sizes: the shards are padded to the widest)."""
    k = len(bounds) - 1
    widest = max(bounds[i + 1] - bounds[i] for i in range(k))
    mine = flat[bounds[levels.local] : bounds[levels.local + 1]]
    padded = torch.zeros(widest, dtype=flat.dtype, device=flat.device)
    padded[: mine.numel()] = mine
    everyone = torch.empty(k * widest, dtype=flat.dtype, device=flat.device)
    all_gather_single(everyone, padded, group=levels.host)
    for i, row in enumerate(everyone.view(k, widest)):
        if i != levels.local:
            flat[bounds[i] : bounds[i + 1]] = row[: bounds[i + 1] - bounds[i]]


def _scatter_reduce_gather(flat: torch.Tensor, bounds: list[int], worker_residual: Optional[torch.Tensor],
                           server_residual: Optional[torch.Tensor], piece: int, among: _Among) -> None:
    """One piece of a quantized or cast compressed all-reduce, in place; chunk i is
    flat[bounds[i]:bounds[i + 1]], reduced by rank i of ``among.group``."""
    compressor, wire, group, stream = among.compressor, among.wire, among.group, among.stream
    n, r = dist.get_world_size(group), dist.get_rank(group)
    me, size = among.streams
    lengths = [bounds[i + 1] - bounds[i] for i in range(n)]
    sizes = [compressor.compressed_nbytes(length) for length in lengths]
    # Each payload in a slot of whole 4-byte words: the CUDA decoders read it in place.
    slots = [aligned(size) for size in sizes]
    outgoing = torch.zeros(sum(slots), dtype=torch.uint8, device=flat.device)
    at = 0
    for i in range(n):
        compressor.encode(
            flat[bounds[i] : bounds[i + 1]],
            None if worker_residual is None else worker_residual[bounds[i] : bounds[i + 1]],
            stream=_encode_stream(stream, me, 0, i, size, piece),
            out=outgoing[at : at + slots[i]],
        )
        at += slots[i]
    incoming = wire.empty(n * slots[r])
    outgoing = wire.send(outgoing)
    among.checked()
    dist.all_to_all_single(incoming, outgoing, [slots[r]] * n, slots, group=group)
    acc = torch.zeros(lengths[r], dtype=torch.float32, device=flat.device)
    accumulate(compressor, wire.receive(incoming.view(n, slots[r]), compressor, [lengths[r]] * n), acc, lengths[r])
    if among.scale != 1.0:
        acc.mul_(among.scale)
    # all_gather_single needs equal sizes: chunk payloads differ by at most one element's worth.
    widest = max(slots)
    padded = torch.zeros(widest, dtype=torch.uint8, device=flat.device)
    compressor.encode(acc, server_residual, stream=_encode_stream(stream, me, 1, r, size, piece), out=padded)
    gathered = wire.empty(n * widest)
    all_gather_single(gathered, wire.send(padded), group=group)
    rows = wire.receive(gathered.view(n, widest), compressor, lengths)
    for j, part in enumerate(rows):
        decode(compressor, part[: sizes[j]], flat[bounds[j] : bounds[j + 1]])
