"""Compressed gradients for sharded training (FSDP2 ``fully_shard``, and HSDP), with error feedback.

FSDP2 reduce-scatters each parameter group's gradient: rank i receives the sum (or average)
of chunk i of every rank's gradient. ``compress_gradients`` replaces that reduce-scatter
with a compressed one: each rank encodes its n chunks with a worker residual, an all-to-all
exchanges the payloads, and rank i decodes and sums the chunks it owns in rank order, in
float32. Only payloads travel, and what compression leaves out stays in the residual and is
sent later. With ``replicate_group`` (HSDP: shard within a group of ranks, replicate across
groups) the shards are then averaged across the replicas by ``compressed_all_reduce``, with
its worker and server residuals::

    from torch.distributed.fsdp import fully_shard
    from ddlcomm import fsdp
    from ddlcomm.compressors import Ternary

    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    state = fsdp.compress_gradients(model, Ternary(), momentum=0.9)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0)  # the momentum is in the communication
    ...                                                    # train as usual
    torch.save({"model": ..., "compression": state.state_dict()}, f"ckpt-{rank}.pt")

The first ``start_compress_iter`` reduce-scatters of each module run uncompressed, and so do
groups smaller than ``min_compression_bytes``, dtypes the compressors do not take and reduce
ops other than SUM and AVG (each reason logged once). Residuals are keyed by the module's
name and checked against the size of its gradients. ``state_dict()`` / ``load_state_dict()``
carry them and the call counts through a checkpoint, one per rank, so that a resumed run
trains bit for bit like an uninterrupted one.

With momentum SGD pass ``momentum=`` (and ``torch.optim.SGD(..., momentum=0)``): every rank
keeps the same averaged momentum ``buf`` of the whole module, sends ``gradient + momentum *
buf`` through ``compressed_all_reduce`` (over the shard group, then the replicas), and the
average becomes ``buf`` and, in the rank's chunk, the reduce-scatter's output. This is what
the DDP hooks do with ``ddlcomm.optim.SGD``; feeding compressed gradients to the optimizer's
momentum loses accuracy, and so does keeping a momentum per rank (docs/fsdp.md). With Adam
or AdamW pass ``adam_betas=`` (and ``torch.optim.SGD(..., momentum=0, weight_decay=wd)``):
the first moment is averaged the same way (1-bit Adam's idea), the second moment of each
rank's chunk comes from its own gradient, and the output is the chunk's Adam step, at most 1
per element (averaged over the replicas under HSDP). Where the average comes out non-finite (a
non-finite gradient on any rank, an overflow) every rank keeps its moments, clears the residuals
and outputs NaN. Not for use with ``torch.amp.GradScaler``: the
scaler would divide the (scale-free) Adam step by its scale.
The compressed reduce-scatter is one C++ implementation for every group and device
(``ddlcomm.compressed.compressed_reduce_scatter``; over hosts of several ranks where the group
takes two levels, by ``ddlcomm.compressed.host_levels_of``'s rule: exact inside each host, only
the host sums compressed across, docs/collectives.md).
``quantize_all_gather`` (from ``ddlcomm.quantized_gather``) sends the parameter all-gathers in 8 bits.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

from .compressors import BF16, FP16, Compressor, all_finite, device_finite
from .compressed import (compressed_all_reduce, compressed_reduce_scatter, reduce_scatter_wire_bytes,
                         server_residual_numel, wire_bytes)
from .moments import normalised_step, update_first, update_second
from .options import CompressionOptions, CompressionStats
from .quantized_gather import AllGatherQuantization, QuantizedAllGather, quantize_all_gather  # re-exported
from .wire import call_stream, ring_all_reduce_bytes, ring_reduce_scatter_bytes

__all__ = ["FSDPCompressionState", "CompressedReduceScatter", "compress_gradients", "AllGatherQuantization",
           "QuantizedAllGather", "quantize_all_gather"]

logger = logging.getLogger(__name__)

_STATE_VERSION = 3  # 2: momentum= averages the momentum; 3: adam_betas= averages the first moment
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# The state's per-module tensors, as state_dict() names them.
_MEMORIES = ("residuals", "server_residuals", "momenta", "exp_avgs", "exp_avg_sqs", "replica_residuals",
             "replica_server_residuals")


# Whether an average came out finite: a bool on the CPU; on a GPU a 0-dim bool tensor there,
# for masks (reading it would wait for the GPU).
_Finite = Union[bool, torch.Tensor]


def _finite(tensor: torch.Tensor) -> _Finite:
    finite = device_finite(tensor)
    return all_finite(tensor) if finite is None else finite


def _agreed(finite: _Finite, group: dist.ProcessGroup) -> _Finite:
    """``finite`` on every rank of ``group``: one byte all-reduced (on a GPU, nothing waits)."""
    device = finite.device if isinstance(finite, torch.Tensor) else torch.device("cpu")
    flag = torch.logical_not(torch.as_tensor(finite, device=device)).to(torch.uint8).reshape(1)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return flag[0] == 0 if isinstance(finite, torch.Tensor) else not bool(flag.item())


def _update_if(finite: _Finite, tensor: torch.Tensor, update: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """``update(tensor)`` (in place) if ``finite``."""
    if isinstance(finite, torch.Tensor):
        torch.where(finite, update(tensor.clone()), tensor, out=tensor)
    elif finite:
        update(tensor)


def _fill_unless(finite: _Finite, tensor: torch.Tensor, value: float) -> None:
    """``tensor`` filled with ``value`` unless ``finite``."""
    if isinstance(finite, torch.Tensor):
        tensor.masked_fill_(finite.logical_not(), value)
    elif not finite:
        tensor.fill_(value)


class FSDPCompressionState(CompressionOptions):
    """Residuals, call counts and statistics of the compressed reduce-scatters (and HSDP
    all-reduces) of one model. Made by ``compress_gradients``; one per rank.

    Attributes:
        compressor, start_compress_iter, min_compression_bytes, error_feedback: as given.
        residuals: module name -> float32 worker residual of its reduce-scatter input (with
            ``momentum``: of the all-reduced momentum).
        server_residuals: module name -> server residual of that all-reduce (``momentum``).
        momenta: module name -> the averaged momentum of the module, the same on every rank.
        exp_avgs: module name -> the averaged Adam first moment of the module, the same on
            every rank of the shard group (``adam_betas``).
        exp_avg_sqs: module name -> this rank's second moment of its chunk, from its own
            gradient (``adam_betas``).
        replica_residuals, replica_server_residuals: module name -> worker and server
            residuals of the all-reduce over ``replicate_group`` (HSDP).
        calls: module name -> reduce-scatters issued so far.
        stats: bytes this rank sent, against an uncompressed ring reduce-scatter.
    """

    _logger = logger

    def __init__(self, compressor: Compressor, start_compress_iter: int = 10,
                 min_compression_bytes: int = 64 * 1024, error_feedback: bool = True,
                 replicate_group: Optional[dist.ProcessGroup] = None, momentum: float = 0.0,
                 adam_betas: Optional[tuple[float, float]] = None, adam_eps: float = 1e-8) -> None:
        super().__init__(compressor, start_compress_iter, min_compression_bytes, error_feedback, momentum)
        if adam_betas is not None:
            if momentum:
                raise ValueError("momentum= (SGD) and adam_betas= (Adam) exclude each other")
            if len(adam_betas) != 2 or not all(0.0 <= float(b) < 1.0 for b in adam_betas):
                raise ValueError(f"adam_betas must be two floats in [0, 1), got {adam_betas!r}")
            adam_betas = (float(adam_betas[0]), float(adam_betas[1]))
        if not adam_eps > 0.0:
            raise ValueError(f"adam_eps must be > 0, got {adam_eps!r}")
        self.adam_betas = adam_betas
        self.adam_eps = float(adam_eps)
        self._advise(compressor, momentum, adam_betas)
        self.replicate_group = replicate_group
        self.residuals: dict[str, torch.Tensor] = {}
        self.server_residuals: dict[str, torch.Tensor] = {}
        self.momenta: dict[str, torch.Tensor] = {}
        self.exp_avgs: dict[str, torch.Tensor] = {}
        self.exp_avg_sqs: dict[str, torch.Tensor] = {}
        self.replica_residuals: dict[str, torch.Tensor] = {}
        self.replica_server_residuals: dict[str, torch.Tensor] = {}
        self.calls: dict[str, int] = {}
        self._index: dict[str, int] = {}  # module name -> its position, for the randomness streams
        self._verified: set[Any] = set()  # modules (and ("replica", module)) whose agreement was checked
        self._spares: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}  # see _spare

    def _advise(self, compressor: Compressor, momentum: float, adam_betas: Optional[tuple[float, float]]) -> None:
        """Says once where these options lost accuracy in docs/results/fsdp_training.md."""
        if isinstance(compressor, (FP16, BF16)):
            return  # a cast only rounds: torch's optimizer on the gradient kept accuracy
        if adam_betas is None and not momentum:
            self.log_once("advice", "ddlcomm.fsdp: compressing gradients with %r and neither momentum= nor "
                          "adam_betas=: with momentum SGD or Adam this lost accuracy "
                          "(docs/results/fsdp_training.md); move the optimizer's momentum into the communication "
                          "with momentum= (SGD) or adam_betas= (Adam, AdamW)", compressor)
        elif adam_betas is not None and compressor.is_sparse:
            self.log_once("advice", "ddlcomm.fsdp: %r with adam_betas= lost accuracy where Ternary() kept it "
                          "(docs/results/fsdp_training.md); consider Ternary()", compressor)

    # -- checkpoints ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This rank's residuals, call counts and statistics (tensors cloned)."""
        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (None, None)
        return {
            "version": _STATE_VERSION,
            "rank": rank,
            "world_size": world,
            "compressor": repr(self.compressor),
            "calls": dict(self.calls),
            "momentum": self.momentum,
            "adam": None if self.adam_betas is None else [*self.adam_betas, self.adam_eps],
            **{kind: {k: v.clone() for k, v in getattr(self, kind).items()} for kind in _MEMORIES},
            "stats": vars(self.stats).copy(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores what ``state_dict`` returned on this rank. Raises ValueError for a newer
        version, another compressor, another rank or world size, or (at first use) residuals
        whose size does not match the module's gradients."""
        version = int(state.get("version", 0))
        if version != _STATE_VERSION:
            raise ValueError(f"FSDP compression state version {version}; this ddlcomm reads {_STATE_VERSION}")
        if float(state["momentum"]) != self.momentum:
            raise ValueError(f"the state was saved with momentum={state['momentum']}, this one has {self.momentum}")
        adam = None if self.adam_betas is None else [*self.adam_betas, self.adam_eps]
        if state["adam"] != adam:
            raise ValueError(f"the state was saved with Adam (betas, eps) {state['adam']}, this one has {adam}")
        if state["compressor"] != repr(self.compressor):
            raise ValueError(f"the state was saved with {state['compressor']}, this one compresses with "
                             f"{self.compressor!r}")
        if state["rank"] is not None and dist.is_initialized():
            here = (dist.get_rank(), dist.get_world_size())
            if here != (state["rank"], state["world_size"]):
                raise ValueError(f"the state was saved by rank {state['rank']} of {state['world_size']}, this is rank "
                                 f"{here[0]} of {here[1]}: each rank loads the state_dict() it saved")
        for kind in _MEMORIES:
            for name, tensor in state[kind].items():
                if tensor.dtype not in (torch.float32, torch.float64) or tensor.dim() != 1:
                    raise ValueError(f"{kind} of {name!r} must be a 1-D float tensor, got {tensor.dtype} "
                                     f"{tuple(tensor.shape)}")
        self.calls = {str(k): int(v) for k, v in state["calls"].items()}
        for kind in _MEMORIES:
            setattr(self, kind, {str(k): v.clone() for k, v in state[kind].items()})
        self.stats = CompressionStats(**state["stats"])

    # -- internals ----------------------------------------------------------------------------
    def _uncompressed_reason(self, name: str, tensor: torch.Tensor, op: Any, calls: int) -> Optional[str]:
        if calls < self.start_compress_iter:
            return "warm-up"
        if tensor.dtype not in _DTYPES:
            self.log_once("dtype", "ddlcomm fsdp: %s gradients are reduce-scattered uncompressed: the compressors "
                           "take float32, float16 and bfloat16", tensor.dtype)
            return "dtype"
        if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            self.log_once("op", "ddlcomm fsdp: reduce op %s is reduce-scattered uncompressed (SUM and AVG are "
                           "compressed); a gradient divide factor makes FSDP2 use another op", op)
            return "op"
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes < self.min_compression_bytes:
            self.log_once("small", "ddlcomm fsdp: parameter groups smaller than min_compression_bytes=%d are "
                           "reduce-scattered uncompressed (the module %r has %d bytes)", self.min_compression_bytes, name,
                           nbytes)
            return "small"
        return None

    def _memory(self, store: dict[str, torch.Tensor], name: str, numel: int, device: torch.device,
                dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """store[name], made (zeros) on first use; checked against the size it must have."""
        tensor = store.get(name)
        if tensor is None:
            tensor = store[name] = torch.zeros(numel, dtype=dtype, device=device)
        elif tensor.numel() != numel:
            raise ValueError(f"ddlcomm fsdp: the memory of {name!r} has {tensor.numel()} elements, where its "
                             f"gradients need {numel}: the state belongs to another model or sharding")
        elif tensor.device != device:
            tensor = store[name] = tensor.to(device)
        return tensor

    def _residuals(self, workers: dict[str, torch.Tensor], servers: dict[str, torch.Tensor], name: str,
                   flat: torch.Tensor, group: dist.ProcessGroup) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """The worker and server residuals of a compressed all-reduce of ``flat`` over ``group``."""
        if not self.error_feedback:
            return None, None
        server = server_residual_numel(flat.numel(), group.rank(), group.size())
        return (self._memory(workers, name, flat.numel(), flat.device),
                self._memory(servers, name, server, flat.device))

    def reduce_scatter(self, name: str, output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup,
                       op: Any) -> None:
        """``output`` = the reduction of chunk ``rank`` of every rank's ``input`` (see the module docs)."""
        n = group.size()
        m = output.numel()
        if input.numel() != n * m:
            raise ValueError(f"ddlcomm fsdp: reduce-scatter input of {input.numel()} elements for an output of {m} "
                             f"on {n} ranks")
        calls = self.calls.get(name, 0)
        self.calls[name] = calls + 1
        index = self._index.setdefault(name, len(self._index))
        nbytes = input.numel() * input.element_size()
        ring = ring_reduce_scatter_bytes(nbytes, n)
        flat = input.view(-1)
        if self.momentum or self.adam_betas is not None:
            self._direction_step(name, output, flat, group, op, calls, call_stream(calls, index))
            return
        if self._uncompressed_reason(name, input, op, calls) is not None:
            self.stats.count(ring, ring, compressed=False)
            dist.reduce_scatter_tensor(output, input, op=op, group=group)
            return
        residual = self._memory(self.residuals, name, flat.numel(), flat.device) if self.error_feedback else None
        stream = call_stream(calls, index)
        # Every rank compresses alike: checked at a module's first call, with a clear error.
        verify = name not in self._verified
        self._verified.add(name)
        average = op == dist.ReduceOp.AVG
        compressed_reduce_scatter(output, flat, self.compressor, residual, group, average, stream, verify)
        self.stats.count(reduce_scatter_wire_bytes(self.compressor, m, n), ring, compressed=True)

    def _spare(self, like: torch.Tensor) -> torch.Tensor:
        """A buffer of ``like``'s size, dtype and device for a new moment, kept between steps: a
        fresh module-sized tensor per step costs as much again in page faults on a CPU."""
        spare = self._spares.pop((like.numel(), like.dtype, like.device), None)
        return torch.empty_like(like) if spare is None else spare

    def _commit(self, store: dict[str, torch.Tensor], name: str, new: torch.Tensor, finite: _Finite) -> torch.Tensor:
        """``store[name]`` becomes ``new`` if ``finite``; the buffer not kept is the spare of its
        size. Returns the moment kept."""
        old = store[name]
        if isinstance(finite, torch.Tensor):
            torch.where(finite, new, old, out=old)
            kept, spare = old, new
        else:
            kept, spare = (new, old) if finite else (old, new)
        store[name] = kept
        self._spares[(spare.numel(), spare.dtype, spare.device)] = spare
        return kept

    def _direction_step(self, name: str, output: torch.Tensor, flat: torch.Tensor, group: dist.ProcessGroup,
                        op: Any, calls: int, stream: int) -> None:
        """The optimizer's momentum is all-reduced instead of the gradient. With ``momentum``,
        ``buf`` (the same on every rank, replicas included) becomes the average of ``flat +
        momentum * buf`` and the output is its chunk. With ``adam_betas``, the first moment (the
        same on every rank of ``group``) becomes the average of ``lerp(m, flat, 1 - beta1)``; the
        second moment of the rank's chunk comes from its own gradient, and the output is the
        chunk's bias-corrected Adam step, at most 1 per element (the replicas average it in
        ``replica_all_reduce``).
        Uncompressed (warm-up, small modules), the average gradient feeds both moments: AdamW.
        Times the group size for SUM. Where the average comes out non-finite (a non-finite
        gradient on any rank, an overflow) every rank keeps its moments, clears the residuals
        and outputs NaN."""
        if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            raise ValueError(f"ddlcomm fsdp: momentum= and adam_betas= need SUM or AVG reduce-scatters; FSDP2 "
                             f"asked for {op} (a gradient divide factor makes it do so)")
        n, r = group.size(), group.rank()
        m = output.numel()
        dtype = torch.float64 if flat.dtype == torch.float64 else torch.float32
        levels = [(group, self.residuals, self.server_residuals)]
        if self.replicate_group is not None and self.adam_betas is None:
            levels.append((self.replicate_group, self.replica_residuals, self.replica_server_residuals))
        scale = n if op == dist.ReduceOp.SUM else 1
        compress = self._uncompressed_reason(name, flat, op, calls) is None
        adam = self.adam_betas is not None
        store = self.exp_avgs if adam else self.momenta
        moment = self._memory(store, name, flat.numel(), flat.device, dtype)
        # The new moment is made beside the old one, which it replaces only where the average
        # came out finite: the average is the same bits on every rank, so every rank decides
        # alike without a flag exchanged per module (on a GPU, without waiting for it).
        if adam and not compress:  # the average gradient feeds both moments: exactly AdamW
            gradient = reduced = flat.to(dtype, copy=True)
        elif adam:
            gradient = flat
            reduced = torch.lerp(moment, flat.to(dtype), 1 - self.adam_betas[0], out=self._spare(moment))
        else:
            reduced = torch.add(flat, moment, alpha=self.momentum, out=self._spare(moment))
        verify = name not in self._verified
        self._verified.add(name)
        residuals: list[torch.Tensor] = []
        for level, (g, workers, servers) in enumerate(levels):
            if compress:
                worker, server = self._residuals(workers, servers, name, reduced, g)
                residuals += [t for t in (worker, server) if t is not None]
                compressed_all_reduce(reduced, self.compressor, worker, server, group=g, average=True,
                                      stream=stream, verify=verify).wait()
            else:
                dist.all_reduce(reduced, group=g)
                reduced.div_(g.size())
            if level == 0:  # the statistics compare the shard group's traffic with a reduce-scatter's
                nbytes = flat.numel() * flat.element_size()
                ring = ring_reduce_scatter_bytes(nbytes, n)
                sent = wire_bytes(self.compressor, flat.numel(), n, r) if compress else ring_all_reduce_bytes(nbytes, n)
                self.stats.count(sent, ring, compress)
        finite = _finite(reduced)
        if adam and self.replicate_group is not None:
            # Each replica averages its own first moment; the replicas average the steps, so
            # they keep or skip theirs together.
            finite = _agreed(finite, self.replicate_group)
        for residual in residuals:  # what they kept of a discarded average would come back later
            _fill_unless(finite, residual, 0.0)
        if adam and not compress:
            _update_if(finite, moment, lambda t: update_first(t, gradient, self.adam_betas[0]))
        else:
            moment = self._commit(store, name, reduced, finite)
        chunk = moment[r * m:(r + 1) * m]
        if not adam:
            output.view(-1).copy_(chunk * scale if scale != 1 else chunk)
        else:
            beta1, beta2 = self.adam_betas
            # The first moment is the group's; the second is of this rank's chunk alone, from its own
            # gradient when compressed (it never sees compression error and costs no traffic). Its
            # variance is left as it is (ranks=1): scaled to the group's batch, as ddlcomm.optim's
            # per-rank moments need, the language model lost accuracy (docs/fsdp.md).
            mine = gradient[r * m:(r + 1) * m].to(dtype)
            second = self._memory(self.exp_avg_sqs, name, m, flat.device, dtype)
            _update_if(finite, second, lambda v: update_second(v, mine, beta2))
            step = normalised_step(chunk, second, calls + 1, beta1, beta2, self.adam_eps, ranks=1)
            output.view(-1).copy_(step.mul_(scale) if scale != 1 else step)
        _fill_unless(finite, output, float("nan"))

    def replica_all_reduce(self, name: str, shard: torch.Tensor) -> None:
        """HSDP: averages this rank's reduced shard (with ``adam_betas``: its Adam step) over
        ``replicate_group``, compressed (with ``momentum`` the reduce-scatter has done so already)."""
        if self.momentum:
            return
        group = self.replicate_group
        flat = shard.view(-1)
        calls = self.calls.get(name, 1) - 1  # counted by this iteration's reduce-scatter
        if self._uncompressed_reason(name, flat, dist.ReduceOp.AVG, calls) is not None:
            dist.all_reduce(flat, group=group)
            flat.div_(group.size())
            return
        worker, server = self._residuals(self.replica_residuals, self.replica_server_residuals, name, flat, group)
        verify = ("replica", name) not in self._verified  # once per module, as for the reduce-scatter
        self._verified.add(("replica", name))
        compressed_all_reduce(flat, self.compressor, worker, server, group=group, average=True,
                              stream=call_stream(calls, self._index.get(name, 0)), verify=verify).wait()


class CompressedReduceScatter(ReduceScatter):
    """The reduce-scatter of one FSDP module (``FSDPModule.set_custom_reduce_scatter``)."""

    def __init__(self, state: FSDPCompressionState, name: str) -> None:
        self.state = state
        self.name = name

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: Any, async_op: bool = False) -> None:
        # FSDP2 waits for the reduce-scatter stream, not for a Work: the call completes here.
        self.state.reduce_scatter(self.name, output_tensor, input_tensor, group, op)


def compress_gradients(model: torch.nn.Module, compressor: Compressor, *, start_compress_iter: int = 10,
                       min_compression_bytes: int = 64 * 1024, error_feedback: bool = True,
                       replicate_group: Optional[dist.ProcessGroup] = None, momentum: float = 0.0,
                       adam_betas: Optional[tuple[float, float]] = None,
                       adam_eps: float = 1e-8) -> FSDPCompressionState:
    """Compresses the gradient reduce-scatter of every ``fully_shard`` module of ``model``.

    Call it after ``fully_shard``. ``replicate_group``: for HSDP, shard with ``fully_shard``
    over the ranks of one replica (a 1-D mesh) and pass the group of ranks holding the same
    shard in the other replicas: the reduced shards are then averaged over it, compressed.
    ``momentum``: SGD's momentum, moved into the communication; use ``torch.optim.SGD`` with
    ``momentum=0``. Every rank keeps the module's averaged momentum ``buf`` (unsharded, the
    same on every rank) and the reduce-scatter becomes a compressed all-reduce of ``gradient
    + momentum * buf``, whose average is the new ``buf`` (DDP's ``ddlcomm.optim.SGD`` with a
    compressed hook does the same). This keeps momentum SGD's accuracy with every compressor
    (docs/fsdp.md). It costs two float32 buffers of the module's unsharded size per rank (the
    momentum and the residual), one more per distinct module size and, with dense compressors, twice the bytes of a compressed
    reduce-scatter; ops other than SUM and AVG are refused.
    ``adam_betas``, ``adam_eps``: Adam (AdamW), moved into the communication the same way; use
    ``torch.optim.SGD(..., momentum=0, weight_decay=wd)``, which for a given direction is
    AdamW's decoupled weight decay. The first moment is averaged like ``momentum``'s buffer
    (the same on every rank); the second, of this rank's chunk alone, comes from its own
    gradient; the output is the chunk's bias-corrected step ``m / (sqrt(v') + eps)``
    (``ddlcomm.moments``). Two float32 buffers of the module's unsharded size per rank (the
    first moment and the residual), one more per distinct module size and one of its chunk.
    Returns the state that holds the residuals (save its ``state_dict()`` with each rank's
    checkpoint).
    """
    state = FSDPCompressionState(compressor, start_compress_iter, min_compression_bytes, error_feedback,
                                 replicate_group, momentum, adam_betas, adam_eps)
    modules = [(name or "<root>", m) for name, m in model.named_modules() if isinstance(m, FSDPModule)]
    if not modules:
        raise ValueError("compress_gradients: the model has no fully_shard module; call fully_shard first")
    for name, module in modules:
        module.set_custom_reduce_scatter(CompressedReduceScatter(state, name))
        if replicate_group is not None:
            module.set_all_reduce_hook(lambda shard, name=name: state.replica_all_reduce(name, shard))
    return state
