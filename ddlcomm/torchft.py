"""ddlcomm as the process group of torchft's fault-tolerant training (docs/torchft.md).

torchft's ``Manager`` reconfigures its process group at every new quorum through
``ProcessGroup.configure(store_addr, replica_id, rank, world_size, ...)``;
``ProcessGroupDdlcomm`` answers each call with a fresh ddlcomm backend over that quorum's
store, as torchft's own ``ProcessGroupGloo`` builds a gloo one::

    from torchft import Manager
    from ddlcomm.torchft import ProcessGroupDdlcomm

    manager = Manager(pg=ProcessGroupDdlcomm(timeout=timedelta(seconds=30)), ...)

A collective that loses a peer raises ``DistBackendError`` naming it, from the ``Work``;
torchft's ``Manager`` catches it, reports the error and drops the step, and the next quorum
(without the lost replica, or with it once it has rejoined) gets a new ddlcomm group.

``compressed_allreduce`` averages a tensor through a ddlcomm compressor with torchft's
semantics (participation, error reporting), for ``DiLoCo``'s pseudo-gradients:
``CompressedAverager(manager, compressor, params).install()``.

Needs torchft, which ddlcomm does not depend on: ``pip install --no-deps torchft`` and its
opentelemetry packages (scripts/setup.sh lists them).
"""

from __future__ import annotations

import atexit
import logging
import weakref
from datetime import timedelta
from typing import Any, Iterable, Optional

import torch
from torch.distributed import Store
from torch.distributed import ProcessGroup as BaseProcessGroup

from . import _C
from .compressors import Compressor

try:
    from torchft.manager import Manager, _ManagedWork
    from torchft.process_group import ProcessGroupWrapper
    from torchft.work import _DummyWork
except ImportError as e:  # ddlcomm itself imports without torchft; this module needs it
    raise ImportError(
        "ddlcomm.torchft needs torchft: pip install --no-deps torchft opentelemetry-api opentelemetry-sdk "
        "opentelemetry-semantic-conventions opentelemetry-proto opentelemetry-exporter-otlp-proto-common "
        "opentelemetry-exporter-otlp-proto-http opentelemetry-exporter-otlp-common "
        f"opentelemetry-exporter-http-transport protobuf (as scripts/setup.sh does) ({e})"
    ) from None

__all__ = ["CompressedAverager", "ProcessGroupDdlcomm", "compressed_allreduce"]

logger = logging.getLogger(__name__)

_live: "weakref.WeakSet[ProcessGroupDdlcomm]" = weakref.WeakSet()


@atexit.register
def _shut_down_live_groups() -> None:
    # Joined while the interpreter is whole: a backend left to the interpreter's teardown has a
    # progress thread that can no longer be joined safely (as ddlcomm/__init__.py does for
    # torch.distributed's groups).
    for group in list(_live):
        group.shutdown()


class ProcessGroupDdlcomm(ProcessGroupWrapper):
    """A reconfigurable ddlcomm process group for torchft's ``Manager``.

    Each ``configure`` (one per quorum) aborts the previous quorum's backend and builds a
    ``ddlcomm._C.ProcessGroupDdlcomm`` over the ``PrefixStore`` torchft names for the quorum
    (``host:port/torchft/<quorum_id>/<group_rank>``), registered in a c10d ``ProcessGroup`` for CPU tensors (and for CUDA ones where torch has
    CUDA; not yet run on a GPU). The collectives
    (``allreduce``, ``allreduce_coalesced``, ``allgather``, ``broadcast``, ``barrier``,
    ``reduce_scatter``, ``alltoall_base``, ``send``/``recv``) go to that group unchanged, through
    torchft's ``ProcessGroupWrapper``.

    Args:
        timeout: bounds connecting each quorum's group, reaching its store, and every
            collective (ddlcomm's group timeout); a silent peer fails the collective after it.
        options: the ddlcomm ``Options`` of every quorum's group (transport, ...), or None.
    """

    def __init__(self, timeout: timedelta = timedelta(seconds=60),
                 options: Optional[_C.ProcessGroupDdlcomm.Options] = None) -> None:
        super().__init__(timeout=timeout)
        self._options = options
        self._backend: Optional[_C.ProcessGroupDdlcomm] = None
        _live.add(self)

    @property
    def backend(self) -> _C.ProcessGroupDdlcomm:
        """The current quorum's ddlcomm backend (its compressed collectives, statistics)."""
        if self._backend is None:
            raise RuntimeError("ProcessGroupDdlcomm is not configured: no quorum yet, or it was aborted")
        return self._backend

    @property
    def group(self) -> BaseProcessGroup:
        """The current quorum's c10d process group, e.g. as ``group=`` of
        ``ddlcomm.compressed.compressed_all_reduce``."""
        return self.parent

    def _create_pg(self, store: Store, rank: int, world_size: int) -> BaseProcessGroup:
        # configure() has aborted the previous quorum's group and made `store` (a PrefixStore of
        # the quorum's TCPStore); global ranks only name this rank in ddlcomm's messages.
        ranks = self._global_ranks if self._global_ranks and len(self._global_ranks) == world_size else []
        name = f"torchft_quorum_{self._quorum_id}"
        backend = _C.ProcessGroupDdlcomm(store, rank, world_size, self._timeout, [int(r) for r in ranks], name,
                                         self._options)
        backend._set_sequence_number_for_group()
        pg = BaseProcessGroup(store, rank, world_size)
        pg._set_default_backend(BaseProcessGroup.BackendType.CUSTOM)
        pg._register_backend(torch.device("cpu"), BaseProcessGroup.BackendType.CUSTOM, backend)
        if torch.cuda.is_available():
            pg._register_backend(torch.device("cuda"), BaseProcessGroup.BackendType.CUSTOM, backend)
        self._backend = backend
        return pg

    def abort(self, errored: bool = True) -> None:
        """Aborts the current quorum's group: its pending work fails, its peers see it closed
        (over shared memory at once, over TCP at their next message), its sockets close."""
        backend, self._backend = self._backend, None
        if backend is not None:
            try:
                backend.abort()
            except Exception as e:  # an already failed group: nothing left to abort
                logger.debug("ddlcomm.torchft: abort of the previous group: %s", e)
        super().abort(errored=errored)  # torchft's error log; drops the c10d group

    def shutdown(self) -> None:
        """Shuts the current group down (joins its progress thread) and forgets it."""
        backend, self._backend = self._backend, None
        if backend is not None:
            try:
                backend.shutdown()
            except Exception as e:
                logger.debug("ddlcomm.torchft: shutdown: %s", e)
        super().shutdown()

    def set_timeout(self, timeout: timedelta) -> None:
        """The timeout of the next quorum's group (and of the current one's later collectives)."""
        super().set_timeout(timeout)
        if self._backend is not None:
            self._backend.set_timeout(timeout)

    def getBackendName(self) -> str:
        return "torchft-ddlcomm"


def compressed_allreduce(manager: Manager, tensor: torch.Tensor, compressor: Compressor,
                         worker_residual: Optional[torch.Tensor] = None, stream: int = 0) -> Any:
    """``manager.allreduce(tensor)`` (an average over the quorum's participants) through
    ddlcomm's compressed all-reduce on the manager's current ddlcomm group.

    Keeps torchft's contract: after an error it does nothing (the step is dropped); a replica
    that is healing contributes zeros (and leaves its residual alone); a failure is reported to
    the manager instead of raised. Every participant ends with the same bits.

    Args:
        manager: a torchft ``Manager`` whose ``pg`` is a ``ProcessGroupDdlcomm``.
        tensor: float32/float16/bfloat16 CPU tensor, overwritten with the average (CUDA tensors:
            ValueError).
        compressor: a ``ddlcomm.compressors`` compressor, the same on every replica.
        worker_residual: float32 error feedback of ``tensor.numel()`` elements, or None.
        stream: the randomness stream (e.g. the manager's step), the same on every replica.

    Returns:
        a torchft ``Work`` whose ``wait()`` returns False after an error (reported).
    """
    if tensor.device.type != "cpu":
        raise ValueError(f"ddlcomm.torchft.compressed_allreduce takes CPU tensors, not {tensor.device} (the "
                         "quorum's group is not in torch.distributed's registry, which the CUDA path needs)")
    if manager.errored():
        return _DummyWork(tensor)
    manager.wait_quorum()
    participants = manager.num_participants()
    participating = manager.is_participating()
    if not participating:
        tensor.zero_()
    pg = manager._pg
    if not isinstance(pg, ProcessGroupDdlcomm):
        raise TypeError(f"compressed_allreduce needs a Manager over ddlcomm.torchft.ProcessGroupDdlcomm, "
                        f"not {type(pg).__name__}")
    try:
        # One level: a quorum's group is not in torch.distributed's registry, where the two
        # levels' subgroups would be made.
        work = _C.CompressedAllreduce(compressor.config, engine=pg.backend).start(
            tensor, worker_residual if participating else None, None, False, int(stream))

        def average(fut: torch.futures.Future) -> torch.Tensor:
            tensor.div_(participants)  # the sum over the quorum, as manager.allreduce averages
            return tensor

        managed = _ManagedWork(manager, work, tensor)
        managed.get_future().then(average)
        return managed
    except Exception as e:
        logger.exception("ddlcomm.torchft: compressed all-reduce failed, skipping the step: %s", e)
        manager.report_error(e)
        return _DummyWork(tensor)


class CompressedAverager:
    """Routes a ``Manager``'s ``allreduce`` (what torchft's ``DiLoCo`` and ``LocalSGD`` average
    their pseudo-gradients or parameters with) through ``compressed_allreduce``, with one
    error-feedback residual per parameter.

    DiLoCo calls ``manager.allreduce`` once per parameter, in ``named_parameters()`` order, at
    every sync; the i-th call of a sync uses the i-th residual (checked by size). The residuals
    are zeroed when a step is dropped (their error belongs to a pseudo-gradient that was thrown
    away) and are not part of the replica's state (a rejoining replica starts with zeros).

    Args:
        manager: a torchft ``Manager`` over ``ProcessGroupDdlcomm``.
        compressor: a ``ddlcomm.compressors`` compressor.
        params: the parameters, in the order the averaged tensors come (DiLoCo's fragments'
            ``parameters()``).
        error_feedback: keep residuals (default) or compress each call afresh.
    """

    def __init__(self, manager: Manager, compressor: Compressor, params: Iterable[torch.nn.Parameter],
                 error_feedback: bool = True) -> None:
        self.manager = manager
        self.compressor = compressor
        self.residuals = [torch.zeros(p.numel(), dtype=torch.float32) if error_feedback else None for p in params]
        self._call = 0
        self._step: Optional[int] = None
        self.calls = 0  # compressed all-reduces started
        self._original = manager.allreduce

    def install(self) -> "CompressedAverager":
        """Replaces ``manager.allreduce`` on this manager (``uninstall`` restores it)."""
        self.manager.allreduce = self.allreduce  # type: ignore[method-assign]
        return self

    def uninstall(self) -> None:
        self.manager.allreduce = self._original  # type: ignore[method-assign]

    def allreduce(self, tensor: torch.Tensor, should_quantize: bool = False, reduce_op: Any = None) -> Any:
        """``Manager.allreduce``'s signature. Averages (``reduce_op`` AVG or None) go through the
        compressor, with ``should_quantize`` ignored (the compressor takes its place); other
        reductions go to the manager's own ``allreduce``."""
        if reduce_op is not None and reduce_op != torch.distributed.ReduceOp.AVG:
            return self._original(tensor, should_quantize, reduce_op)
        n = len(self.residuals)
        step = self.manager.current_step()
        if step != self._step:  # a new sync: the first parameter again
            self._step, self._call = step, 0
        elif self._call and self._call % n == 0:  # another sync at the same step: the last was dropped
            for r in self.residuals:
                if r is not None:
                    r.zero_()
        index = self._call % n
        self._call += 1
        residual = self.residuals[index]
        if residual is not None and residual.numel() != tensor.numel():
            raise ValueError(f"CompressedAverager: call {index} of a sync averages {tensor.numel()} elements, "
                             f"parameter {index} has {residual.numel()}: pass the parameters in DiLoCo's order")
        stream = step * n + index
        self.calls += 1
        return compressed_allreduce(self.manager, tensor, self.compressor, residual, stream)
