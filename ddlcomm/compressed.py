"""Compressed all-reduce with error feedback, on any process group.

One implementation, in C++ (``csrc/torch/collective_compressed.cc``), serves every group and
device, over the backends' all-to-all and all-gather. ``route_of`` binds it to a group and a
compressor once (``_C.CompressedAllreduce``); each call is then one ``start`` that returns at
once with a Work on every backend. Where the group's collectives run on the CPU (CPU tensors;
CUDA tensors over gloo or ddlcomm) a call is one operation on the executor of the group's
ddlcomm backend (``engine_of``): a ddlcomm group's own, or on a group of another backend (gloo,
a third party's) one over that backend's send and recv. Every rank ends with the same bits on
every kind of group. Over several hosts of as many ranks it takes two levels (where
``two_levels`` says): exact inside each host, compressed across.

Quantizers and casts (1-bit, ternary, fp16, bf16) use scatter-reduce-gather with two
levels of error feedback, in pieces of 16 Mi elements (one piece is encoded while the one
before it is on the wire). In each piece every rank encodes its part in n chunks with its
worker residual; rank i decodes and sums chunk i from every rank in rank order, re-encodes the
sum with its server residual; an all-gather of those payloads gives every rank the same bytes.
Sparse formats (top-k, random-k) all-gather the (index, value) payloads and sum them in rank
order. Random-k's sample can miss a non-finite entry, so a flag all-reduced first makes the
result non-finite everywhere (a GradScaler skips the step) and leaves the residuals alone.

CUDA tensors are encoded and decoded on their GPU, one call per bucket. Over NCCL it runs on
the caller's thread, on the current stream: the payloads stay in device memory and nothing
waits on the host. Over gloo and ddlcomm (whose collectives run on the CPU) the executor's
thread issues its kernels on a stream of torch's pool, after the caller's stream, and only the
payloads cross PCIe, through pinned host memory: each copy is waited for by a CUDA event, never
a device synchronization, and what arrives is validated on the host before it goes back to the
GPU. The result is bitwise the same as on the CPU for the deterministic formats (the CUDA kernels are
bit-exact twins of the CPU ones).
"""

from __future__ import annotations

import atexit
import datetime
import functools
import logging
from typing import Any, Optional

import torch
import torch.distributed as dist

from . import _C
from .compressors import Compressor
from .host_levels import HostLevels, destroyed, forget_groups, host_levels
from .wire import Agreement, collectives_on_gpu

__all__ = [
    "all_reduce_over_collectives", "check_agreement", "compressed_all_reduce", "compressed_reduce_scatter",
    "engine_of", "route_of",
    "host_levels_of", "server_chunks",
    "server_residual_numel", "native_backend", "reduce_scatter_wire_bytes", "two_levels", "wire_bytes",
]

logger = logging.getLogger(__name__)


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
# by group name, device, compressor and flat
_routes: dict[tuple[str, str, str, bool], tuple[dist.ProcessGroup, _C.CompressedAllreduce]] = {}


def engine_of(group: Optional[dist.ProcessGroup] = None) -> Optional[_C.ProcessGroupDdlcomm]:
    """Whose executor runs the compressed all-reduce on ``group`` (default: the world) where the
    group's collectives run on the CPU (CPU tensors, and CUDA tensors over gloo or ddlcomm), over
    whose collectives: one operation, so that the call returns with it in flight and its
    exchanges keep their place among the group's other operations.

    A ddlcomm group's own backend; on a group of another backend with CPU collectives (gloo, a
    third party's), a ddlcomm backend whose messages travel as that backend's send and recv
    (``ProcessGroupDdlcomm.over``), made at the group's first compressed call: that call is
    collective (every rank connects through the group's store). Its tags have bit 30 set: the
    user's own send and recv on the group keep tags below 2**30, and its collectives never
    interleave with the user's on the group. Where every rank of the group is on one host they
    exchange through shared memory instead, as on a ddlcomm group (``DDLCOMM_TRANSPORT=tcp``:
    over the group's backend there too). None where the group has no CPU backend (nccl only)."""
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
    # Registered with torch: the compressed collectives take only such groups (their sizes and
    # ranks come from torch's registry).
    store = dist.distributed_c10d._get_process_group_store(group)
    timeout = getattr(getattr(carrier, "options", None), "_timeout", None) or datetime.timedelta(minutes=30)
    # Its own collectives are flat: the two levels, where the group takes them, are host_levels_of's.
    engine = _C.ProcessGroupDdlcomm.over(carrier, store, timeout, group.group_name, "ring")
    _engines[group.group_name] = (group, engine)
    return engine


def _forget_destroyed_groups() -> None:
    """Drops the engines, routes and levels of destroyed groups: each holds its group's connections."""
    for cache in (_engines, _routes):
        for key, (group, _) in list(cache.items()):
            if destroyed(group):
                del cache[key]
    forget_groups()


def _forget_all() -> None:
    _routes.clear()
    _engines.clear()
    forget_groups(every=True)


# Joined while the interpreter is whole, not in its teardown.
atexit.register(_forget_all)


def server_chunks(numel: int, rank: int, world_size: int, group: Optional[dist.ProcessGroup] = None,
                  compressor: Optional[Compressor] = None, flat: bool = False) -> list[tuple[int, int]]:
    """The [begin, end) ranges of the vector that `rank` reduces (its chunk of every piece),
    in the order its server residual holds them. Given the compressor (`rank` must then be this
    rank): the plan that group runs, the hierarchical one where its hosts take it
    (docs/collectives.md; on a group of another backend, finding its hosts is collective the
    first time); without it, or with `flat` (a call that asked for one level), the flat plan."""
    if compressor is not None and not flat and not compressor.is_sparse and world_size > 1:
        levels = host_levels_of(group or dist.group.WORLD)
        if levels is not None:
            return [tuple(c) for c in levels.plan(numel)["server_chunks"]]
    return [tuple(c) for c in _C.ProcessGroupDdlcomm.compressed_allreduce_server_chunks(numel, rank, world_size)]


def host_levels_of(group: dist.ProcessGroup) -> Optional[HostLevels]:
    """The two levels the compressed collectives take on `group` (a ddlcomm group's by its own
    allreduce_algorithm), or None for one; collective the first time on a group."""
    backend = native_backend(group)
    return host_levels(group, None if backend is None else backend.options.allreduce_algorithm, backend is not None)


def two_levels(group: Optional[dist.ProcessGroup] = None) -> bool:
    """Whether compressed all-reduces on `group` take two levels over its hosts (exact inside
    each, compressed across) unless a call passes ``flat=True``; collective the first time on a
    group (``host_levels_of``)."""
    group = group or dist.group.WORLD
    return dist.get_world_size(group) > 1 and host_levels_of(group) is not None


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
    ``DistBackendError`` itself, wait on the Work of ``route_of(...).start(...)``, the same
    call without the checks (``check_agreement`` is ``verify``'s).

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
        verify: first check that every rank reduces as many elements of one dtype with one
            compressor (one small all-gather; ValueError on every rank if not, the group still
            usable). Skip it only where the caller has checked that itself, as the DDP hooks do
            once per bucket. An unchecked mismatch fails in the exchange (an all-to-all of
            different sizes, or a payload of another compressor) and may end the group.
        flat: one level (every rank compresses for the whole group) where the group takes two
            over its hosts (``two_levels``); every rank must pass the same. The server
            residual's places differ between the two plans (``server_chunks``).
    """
    if not isinstance(tensor, torch.Tensor) or not isinstance(compressor, Compressor):
        raise TypeError(f"compressed_all_reduce takes a tensor and a ddlcomm.compressors compressor, got "
                        f"{type(tensor).__name__} and {type(compressor).__name__}")
    if group is None and not dist.is_initialized():  # as torch's collectives say it
        raise ValueError("compressed_all_reduce: the default process group has not been initialized: call "
                         "torch.distributed.init_process_group first")
    group = group or dist.group.WORLD
    route = route_of(tensor, compressor, group, flat)
    if verify:
        check_agreement(tensor, compressor, group)
    work = route.start(tensor, worker_residual, server_residual, average, int(stream))
    return work.get_future().then(lambda fut: fut.value()[0])


def route_of(tensor: torch.Tensor, compressor: Compressor, group: Optional[dist.ProcessGroup] = None,
             flat: bool = False) -> _C.CompressedAllreduce:
    """The compressed all-reduce of ``compressor`` on ``group`` (default: the world) for tensors
    on ``tensor``'s device, in one level if ``flat``: one C++ object, kept per group, device,
    compressor and level, whose ``start(tensor, worker_residual, server_residual, average,
    stream)`` runs a call and returns a ``Work`` at once (arguments as ``compressed_all_reduce``'s;
    its future holds ``[tensor]``). A DDP hook starts it once per bucket. Where the group's
    collectives run on the CPU it runs as one operation on the executor of ``engine_of(group)``;
    over NCCL on the caller's thread, on the current stream. It checks nothing across ranks
    (``check_agreement`` does). Collective the first time on a group (``engine_of``,
    ``host_levels_of``)."""
    group = group or dist.group.WORLD
    key = (group.group_name, str(tensor.device), repr(compressor), flat)
    cached = _routes.get(key)
    if cached is not None and cached[0] is group:
        return cached[1]
    _forget_destroyed_groups()
    backends, host, across, identities, staged = _levels_of(tensor, group, flat)
    engine = engine_of(group) if staged or tensor.device.type == "cpu" else None
    route = _C.CompressedAllreduce(compressor.config, None if engine is not None else backends, host, across,
                                   identities, staged, engine)
    _routes[key] = (group, route)
    return route


def check_agreement(tensor: torch.Tensor, compressor: Compressor, group: Optional[dist.ProcessGroup] = None) -> None:
    """Checks that every rank of ``group`` reduces as many elements of one dtype with one
    compressor (one small all-gather): a ValueError on every rank if not, the group still
    usable. Run before the first exchange, and before the exact sums inside a host, which gloo
    cannot check."""
    group = group or dist.group.WORLD
    Agreement(tensor, compressor, group, dist.get_world_size(group), True, _collectives_device(tensor, group)).wait()


def _backends(group: dist.ProcessGroup, tensor: torch.Tensor, payloads: torch.device) -> tuple[Any, Any]:
    """``group``'s backends for ``tensor``'s values and for its payloads."""
    return group._get_backend(tensor.device), group._get_backend(payloads)


def all_reduce_over_collectives(tensor: torch.Tensor, compressor: Compressor, worker_residual: Optional[torch.Tensor],
                                server_residual: Optional[torch.Tensor], group: Optional[dist.ProcessGroup],
                                average: bool, stream: int, verify: bool, flat: bool) -> None:
    """``compressed_all_reduce`` on the caller's thread over the group's own collectives
    (arguments as there), where ``compressed_all_reduce`` runs a CPU tensor over the engine's
    (``engine_of``): the same C++ implementation, bytes and sums either way (the tests and
    ``bench.engine`` compare them). Blocking only where the group's backend blocks."""
    group = group or dist.group.WORLD
    levels = _levels_of(tensor, group, flat)
    if verify:
        check_agreement(tensor, compressor, group)
    _C.CompressedAllreduce(compressor.config, *levels).start(tensor, worker_residual, server_residual, average,
                                                             int(stream)).wait()


def compressed_reduce_scatter(output: torch.Tensor, input: torch.Tensor, compressor: Compressor,
                              worker_residual: Optional[torch.Tensor], group: dist.ProcessGroup, average: bool,
                              stream: int, verify: bool = True) -> None:
    """``output`` = the compressed reduction of chunk ``rank`` of every rank's ``input``
    (``ddlcomm.fsdp``'s reduce-scatter), blocking, over the group's all-to-all (and, in two
    levels where ``host_levels_of`` takes them, its reduce-scatter inside each host): one C++
    implementation for every group and device. Each rank encodes chunk ``o`` with the residual of that
    chunk (``worker_residual``: ``input.numel()`` float32 elements, or None) and the sum of what
    rank ``o`` receives is taken in float32, in rank order. `verify`: first check that every
    rank reduces alike (a ValueError on every rank if not). CPU tensors: one operation on the
    executor of the group's ddlcomm backend (``engine_of``), waited for; others on the caller's
    thread."""
    levels = _levels_of(input, group, False)
    if verify:
        check_agreement(input, compressor, group)
    engine = engine_of(group) if not input.is_cuda else None
    if engine is not None:
        _, host, across, identities, _ = levels
        engine.compressed_reduce_scatter(output, input, compressor.config, worker_residual, average, stream, host,
                                         across, identities).wait()
        return
    _C.compressed_reduce_scatter_over_collectives(output, input, compressor.config, worker_residual, average, stream,
                                                  *levels)


def _levels_of(tensor: torch.Tensor, group: dist.ProcessGroup, flat: bool) -> tuple[Any, ...]:
    """The group as the C++ implementation takes it: (its backends, the host's and the
    across-hosts' where it takes two levels (else None), every rank's host identity, staged).
    Each is (the backend of the tensor's device, that of its payloads): payloads of a CUDA
    tensor over a backend whose collectives run on the CPU travel through pinned host memory
    (staged), where what arrives is validated. Collective the first time on a group."""
    levels = host_levels_of(group) if dist.get_world_size(group) > 1 and not flat else None
    payloads = _collectives_device(tensor, group)
    staged = payloads != tensor.device
    if levels is None:
        return _backends(group, tensor, payloads), None, None, [], staged
    return (_backends(group, tensor, payloads), _backends(levels.host, tensor, payloads),
            _backends(levels.across, tensor, payloads), levels.identities, staged)


def _collectives_device(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.device:
    """Where `group`'s collectives of `tensor`'s payloads run: on its GPU over NCCL, else on the
    CPU (gloo and ddlcomm stage CUDA tensors through host memory)."""
    return tensor.device if not tensor.is_cuda or collectives_on_gpu(group, tensor.device) else torch.device("cpu")
