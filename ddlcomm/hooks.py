"""DDP communication hooks that send compressed gradients with error feedback.

Usage, in the style of PyTorch's ``powerSGD_hook``::

    from ddlcomm import hooks, optim
    from ddlcomm.compressors import OneBit

    opt = optim.SGD(model.parameters(), lr=0.1, momentum=0.9)   # a drop-in torch.optim.SGD
    state = hooks.CompressionState(compressor=OneBit(), optimizer=opt)
    model.register_comm_hook(state, hooks.compressed_hook)

The hook returns the average over the ranks, like DDP's default hook. With an
``optimizer`` from ``ddlcomm.optim`` (SGD, Adam, AdamW) and a lossy compressor, the hook
averages each rank's update direction (its new momentum; for Adam its normalised step)
rather than its gradient: error feedback on the gradient, fed through momentum or Adam,
costs accuracy at the usual learning rates, and averaging the direction does not
(``ddlcomm.optim`` says why; ``docs/choosing-a-compressor.md`` has the measurements).
Through FP16 and BF16, and without an optimizer, the hook averages the gradient itself, so
``clip_grad_norm_`` and ``GradScaler`` work as with DDP's default hook.

The first ``start_compress_iter`` iterations run uncompressed (DDP rebuilds its buckets
after the first iteration, and early gradients are large and noisy). Buckets smaller
than ``min_compression_bytes`` always go uncompressed. With ``adaptive=True`` the buckets are
sent exactly, in bfloat16 or through the compressor, whichever was measured to finish
iterations first (``ddlcomm.adaptive``). One compressed all-reduce serves ddlcomm, gloo and
nccl groups with bitwise the same result (``ddlcomm.compressed``).

Error-feedback memory (a worker and a server residual per bucket) is keyed by the bucket's
parameters (``ddlcomm.ddp_memory``). ``state_dict()`` / ``load_state_dict()`` carry it through
a checkpoint, one per rank, and a resumed run trains bit for bit like an uninterrupted one:
the first iteration after a load is reduced in the saved bucket layout (a fresh DDP wrapper
starts in another one), and a changed layout (``bucket_cap_mb``) takes its memory parameter
by parameter. CUDA buckets are compressed on their GPU, their residuals live there, and
only payloads cross PCIe (``ddlcomm.compressed``). Non-finite gradients come out non-finite
(so ``GradScaler`` skips the step) without poisoning the residuals. A communication failure raises its own exception
(``DistBackendError``) from ``backward()``.

``CompressionState`` holds one part per concern, each checking its own arguments (its
docstring lists them by concern, each with the module it comes from).
"""

import logging
from typing import Any, NamedTuple, Optional

import time

import torch
import torch.distributed as dist

from .adaptive import Tuner
from .clipping import NormClipping
from .compressors import BF16, FP16, Compressor, Ternary, has_cuda
from .dgc import DgcCorrection
from .compressed import check_agreement, native_backend, route_of, two_levels, wire_bytes
from .ddp_memory import FeedbackMemory, ParameterKeys, Signature
from .hook_checkpoint import HookCheckpoint
from .hook_iterations import Iterations
from .optim import DirectionOptimizer, averages_directions, for_compressor
from .options import CompressionOptions, CompressionStats
from .wire import call_stream, ring_all_reduce_bytes

__all__ = ["CompressionState", "CompressionStats", "compressed_hook"]

logger = logging.getLogger(__name__)


class CompressionState(CompressionOptions):
    """State of the compressed DDP communication hook (``compressed_hook``).

    Args:
        process_group: the group to reduce over (default: the world).
        compressor: a ``ddlcomm.compressors`` compressor (``OneBit()``, ``Ternary()``,
            ``TopK(ratio=0.01)``, ``RandomK(...)``, ``FP16()``, ``BF16()``); None means
            ``Ternary()``, which kept plain all-reduce's accuracy on every recipe measured with
            SGD and Adam (docs/choosing-a-compressor.md); ``OneBit()`` sends less.
        start_compress_iter: iterations that run uncompressed first (at least 2: DDP
            rebuilds its buckets after the first iteration).
        min_compression_bytes: buckets smaller than this go uncompressed (logged once).
        error_feedback: keep residuals (recommended; without them 1-bit SGD diverges).
        optimizer: the model's optimizer, a ``ddlcomm.optim`` one (SGD, Adam, AdamW) or torch's
            SGD, Adam or AdamW, which becomes one in place (``ddlcomm.optim.convert``): a lossy
            compressor then averages each rank's update direction instead of its gradient,
            which keeps the accuracy of momentum SGD and Adam (see the module docs).
            Recommended for every lossy compressor; FP16 and BF16 average the gradient with
            or without it. Where the optimizer is built after the hook is registered (a
            framework's), pass it later with ``attach``.
        model: the model (or its DDP wrapper). Its parameter names key the error-feedback
            memory in ``state_dict()``; without it, positions in ``optimizer``'s parameter
            groups do. ``state_dict()`` needs one of the two.
        momentum: DGC momentum correction for sparse compressors (top-k, random-k) without
            ``optimizer``: the momentum is accumulated locally and its sent entries are
            cleared (momentum factor masking). Use it with a plain SGD optimizer without
            momentum.
        clip_norm: DGC local gradient clipping, with ``momentum``: each rank clips its bucket's
            gradient to norm ``clip_norm / sqrt(world_size)`` before accumulating it. It is not
            ``clip_grad_norm_``, which works unchanged between ``backward()`` and ``step()``
            with FP16/BF16 or without ``optimizer=`` (with a lossy compressor and
            ``optimizer=``, ``.grad`` holds averaged directions and ``step()`` refuses a
            rewritten one).
        max_grad_norm: clip as ``torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)``
            would on the average gradient, for a lossy compressor with ``optimizer=`` (where
            ``.grad`` holds directions and ``clip_grad_norm_`` is refused). The norm of the
            average gradient is exact in uncompressed iterations (the warm-up) and estimated
            from a sketch, to about 1-3%, in compressed ones (``ddlcomm.clipping``); the
            iteration's buckets are then reduced after backward() rather than during it. With
            FP16/BF16 or without ``optimizer=``, call ``clip_grad_norm_`` as usual.
        adaptive: send the buckets exactly, in bfloat16 or through ``compressor``, whichever
            finished iterations first when they were tried (4 iterations each after the
            warm-up, and again every 1000 iterations; ``ddlcomm.adaptive``); on a group that
            takes two levels over hosts, the compressor in one level is tried too; so is a plan
            per bucket where a cost model fitted to the buckets' timed transfers proposes one
            that mixes options (CPU buckets). The choice is the same on every rank and logged at
            INFO level; with ``optimizer=`` every option averages update directions.

    Attributes, by concern:
        compressor, start_compress_iter, min_compression_bytes, error_feedback, momentum: as
            given, checked by ``ddlcomm.options.CompressionOptions`` (shared with ``ddlcomm.fsdp``).
        stats: a ``CompressionStats``: bytes sent against a plain ring all-reduce's, and
            buckets compressed and not (``stats.ratio``, ``stats.compression_ratio``).
        process_group, model: as given.
        memory: the error-feedback memory (``ddlcomm.ddp_memory.FeedbackMemory``), and
            ``keys``, what it knows the parameters by (``ParameterKeys``).
        optimizer: the ``ddlcomm.optim`` optimizer whose directions the hook averages
            (``attach``, ``averages_directions``), or None.
        dgc: with ``momentum`` or ``clip_norm``, DGC's corrections (``ddlcomm.dgc.DgcCorrection``);
            else None.
        clipping: with ``max_grad_norm``, a ``ddlcomm.clipping.NormClipping``; else None.
            ``max_grad_norm`` is its norm, and ``grad_norm`` the last iteration's norm of the
            average gradient before clipping (what ``clip_grad_norm_`` returns), a tensor; both
            None without it.
        tuner: with ``adaptive``, the ``ddlcomm.adaptive.Tuner`` (its ``choice``); else None.
        iterations: the iterations (``ddlcomm.hook_iterations.Iterations``); ``iter`` is their
            count (the warm-up ends when it reaches ``start_compress_iter``).
        checkpoint: what saves and loads the rest (``state_dict``, ``load_state_dict``, pickling)
            and checks a loaded state at the next bucket (``ddlcomm.hook_checkpoint.HookCheckpoint``).

    The first iteration logs, at INFO level, the compressor and when compression starts.
    """

    _logger = logger

    def __init__(
        self,
        process_group: Optional[dist.ProcessGroup] = None,
        compressor: Optional[Compressor] = None,
        start_compress_iter: int = 10,
        min_compression_bytes: int = 64 * 1024,
        error_feedback: bool = True,
        optimizer: Optional[torch.optim.Optimizer] = None,
        model: Optional[torch.nn.Module] = None,
        momentum: float = 0.0,
        clip_norm: Optional[float] = None,
        max_grad_norm: Optional[float] = None,
        adaptive: bool = False,
    ) -> None:
        # Each part checks its own arguments; here only what relates two of them, or the hook.
        # The compressor, its options and statistics (CompressionOptions).
        super().__init__(compressor if compressor is not None else Ternary(), start_compress_iter,
                         min_compression_bytes, error_feedback, momentum)
        compressor = self.compressor
        if start_compress_iter < 2:
            raise ValueError("start_compress_iter must be at least 2: DDP rebuilds its buckets after iteration 1")
        # What the hook does to the buckets besides compressing them.
        self.dgc = DgcCorrection(momentum, clip_norm, compressor) if momentum or clip_norm is not None else None
        lossy = not isinstance(compressor, (FP16, BF16))
        self.clipping = (NormClipping(max_grad_norm, grad_holds_directions=optimizer is not None and lossy)
                         if max_grad_norm is not None else None)
        if adaptive and momentum:
            raise ValueError("adaptive=True chooses among exact, bfloat16 and the compressor; DGC's "
                             "momentum= masks by what the sparse compressor sent and cannot follow the switches: "
                             "use optimizer= instead")
        self.tuner = Tuner(compressor, start_compress_iter) if adaptive else None
        # Where it reduces, and the error-feedback memory, keyed by parameter (ddlcomm.ddp_memory).
        if model is not None and not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        self.process_group = process_group
        self.model = model
        self.memory = FeedbackMemory()
        self.keys = ParameterKeys()
        self._verified: set[tuple[Signature, str]] = set()  # (bucket, compressor) checked across ranks
        # The optimizer whose update directions it averages.
        self.optimizer: Optional[DirectionOptimizer] = None
        if optimizer is not None:
            self.attach(optimizer)
        self.iterations = Iterations()
        self.checkpoint = HookCheckpoint()

    # -- the optimizer whose update directions are averaged ------------------------------
    def attach(self, optimizer: torch.optim.Optimizer) -> DirectionOptimizer:
        """Sets the optimizer whose update directions the hook averages (``optimizer=``), for
        one built after the hook was registered, as frameworks do; before compression starts.
        torch's SGD, Adam and AdamW become the ``ddlcomm.optim`` optimizer of the same name in
        place (logged once). Returns the optimizer."""
        if optimizer is self.optimizer:
            return optimizer
        if self.dgc is not None:
            raise ValueError("momentum= is DGC's local momentum for an optimizer without one; with optimizer= "
                             "the optimizer's own momentum is what the hook compresses")
        if self.optimizer is not None or self.stats.compressed_buckets:
            raise ValueError("ddlcomm hook: attach the optimizer once, before compression starts (the error-feedback "
                             "memory of gradients and of update directions cannot be mixed)")
        self.optimizer = for_compressor(optimizer, self.compressor)
        return self.optimizer

    @property
    def averages_directions(self) -> bool:
        """Whether compressed buckets carry the optimizer's update directions, not gradients (a
        ``ddlcomm.optim`` optimizer with a lossy compressor): ``.grad`` then holds directions
        after a compressed ``backward()``, which ``clip_grad_norm_`` and ``GradScaler`` must
        not rewrite. FP16 and BF16 only round, so they always average the gradient."""
        return averages_directions(self.optimizer, self.compressor)

    # -- what the parts hold -------------------------------------------------------------
    @property
    def iter(self) -> int:
        """Iterations run (``iterations.count``); the warm-up ends when it reaches ``start_compress_iter``."""
        return self.iterations.count

    @iter.setter
    def iter(self, count: int) -> None:
        self.iterations.count = count

    @property
    def max_grad_norm(self) -> Optional[float]:
        """``clipping.max_norm``: ``max_grad_norm`` as given, or None."""
        return None if self.clipping is None else self.clipping.max_norm

    @property
    def grad_norm(self) -> Optional[torch.Tensor]:
        """``clipping.norm``: the last iteration's norm before clipping, or None."""
        return None if self.clipping is None else self.clipping.norm

    # -- checkpoints ---------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything this rank needs to resume exactly: iteration, error-feedback memory keyed
        by parameter, the bucket layout, statistics, the adaptive choices, and the rank and world
        size it belongs to.

        Each rank saves and loads its own: the memory differs between ranks.
        """
        return self.checkpoint.state_dict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores what ``state_dict`` returned on this rank (tensors are copied).

        Raises ValueError for a state saved by another rank or world size (checked here when
        the process group exists, else on first use) or for another model. States from
        versions before 3 (memory keyed by bucket index) keep their iteration and statistics;
        their error-feedback memory restarts from zero (logged). A newer version is refused.
        """
        self.checkpoint.load_state_dict(self, state)

    def __getstate__(self) -> dict[str, Any]:
        # Process groups do not pickle, and the model and optimizer are saved by their owner
        # (the hook refuses to run until they are set again); the rest does (torch.save of a
        # whole state).
        checkpoint = self.checkpoint.pickled(self)
        state = {k: v for k, v in self.__dict__.items() if k not in ("process_group", "optimizer", "model")}
        state["checkpoint"] = checkpoint
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.checkpoint.unpickled(self)

    # -- bookkeeping ---------------------------------------------------------------------
    def rank_and_world(self) -> tuple[int, int]:
        """This rank and the world size in ``process_group`` (the world's when None)."""
        group = self.process_group or dist.group.WORLD
        return dist.get_rank(group), dist.get_world_size(group)

    def _signature(self, params: list[torch.Tensor], numel: int, index: int) -> tuple[Signature, list[int]]:
        return self.keys.signature(params, numel, index, self.model, self.optimizer)


def compressed_hook(state: CompressionState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Averages ``bucket`` over the ranks through ``state.compressor``: the gradients, or with a
    ``ddlcomm.optim`` optimizer and a lossy compressor the update directions (module docs)."""
    state.checkpoint.check_loaded(state)
    if state.iter == 0 and bucket.index() == 0:
        logger.info("ddlcomm hook: %r%s from iteration %d (the first %d uncompressed)", state.compressor,
                    " averaging update directions" if state.averages_directions else "", state.start_compress_iter,
                    state.start_compress_iter)
    if bucket.index() == 0 and state.tuner is not None:
        state.tuner.iteration_began(state.iter, state.process_group, bucket.buffer().device)
    if state.iterations.replay_left or state.clipping is not None:
        return _whole_iteration(state, bucket)
    return _reduce(state, bucket.buffer(), bucket.parameters(), bucket.index(), bucket.is_last())


def _whole_iteration(state: CompressionState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Collects every bucket of the iteration, then reduces them: with ``max_grad_norm``, so that
    the norm over all of them is known before any is clipped; right after a load, in the saved
    layout (the one the uninterrupted run used), so a resumed run trains exactly like it. A new
    DDP wrapper rebuilds its buckets after its first iteration (its second with static_graph);
    a layout still different after that (another bucket_cap_mb) takes its memory parameter by
    parameter instead (FeedbackMemory)."""
    done: torch.futures.Future = torch.futures.Future()
    state.iterations.hold(bucket.buffer(), bucket.parameters(), done)
    if not bucket.is_last():
        return done
    buckets = state.iterations.take_held()
    try:
        groups = [(buffer, params) for buffer, params, _ in buckets]
        views = {}
        if state.iterations.replay_left:
            current = [state._signature(params, buffer.numel(), i)[0] for i, (buffer, params) in enumerate(groups)]
            for signature, (buffer, params) in zip(current, groups):
                if len(signature) == len(params):
                    views.update(zip(signature, zip(params, _gradients(buffer, params))))
            saved = state.memory.layout
            state.iterations.replayed(same_layout=current == saved)
            if current != saved and sorted(k for s in saved for k in s) == sorted(views):
                groups = [(torch.cat([views[k][1].reshape(-1) for k in signature]), [views[k][0] for k in signature])
                          for signature in saved]
        for (buffer, params), result in zip(groups, _reduce_all(state, groups)):
            if buffer is not result:
                buffer.copy_(result)
            if not any(buffer is b for b, _, _ in buckets):  # a saved bucket: back to the current ones
                for view, part in zip(_gradients(buffer, params), params):
                    views[state.keys.key(part)][1].copy_(view)
    except BaseException as error:  # every bucket's future fails, as a failed all-reduce would
        for _, _, fut in buckets:
            fut.set_exception(error)
        raise
    for buffer, _, fut in buckets:
        fut.set_result(buffer)
    return done


def _reduce_all(state: CompressionState, groups: list[tuple[torch.Tensor, list[torch.Tensor]]]) -> list[torch.Tensor]:
    """Reduces one iteration's buckets in order and returns their averages, clipped first with
    ``max_grad_norm`` (``ddlcomm.clipping.clip_iteration``)."""
    def reduce_all() -> list[torch.Tensor]:
        futures = [_reduce(state, buffer, params, i, i == len(groups) - 1) for i, (buffer, params) in enumerate(groups)]
        return [fut.wait() for fut in futures]

    if state.clipping is None:
        return reduce_all()
    compressed = any(_uncompressed_reason(state, b, b.numel() * b.element_size()) is None for b, _ in groups)
    results, sent = state.clipping.reduce([b for b, _ in groups], reduce_all, compressed, state.iter,
                                          state.process_group)
    state.stats.bytes_sent += sent
    return results


class _Bucket(NamedTuple):
    """One bucket of one iteration, as the hook reduces it."""

    buffer: torch.Tensor
    params: list[torch.Tensor]
    signature: Signature  # its parameters' keys in the error-feedback memory
    index: int
    nbytes: int


def _reduce(state: CompressionState, buffer: torch.Tensor, params: list[torch.Tensor], index: int,
            last: bool) -> torch.futures.Future[torch.Tensor]:
    """One bucket of one iteration: compressed or plain all-reduce, averaged."""
    signature, numels = state._signature(params, buffer.numel(), index)
    state.memory.note_bucket(index, signature, numels)
    nbytes = buffer.numel() * buffer.element_size()
    bucket = _Bucket(buffer, params, signature, index, nbytes)
    reason = _uncompressed_reason(state, buffer, nbytes)
    world = state.rank_and_world()[1]
    if reason is not None:
        ring = ring_all_reduce_bytes(nbytes, world)
        state.stats.count(ring, ring, compressed=False)
        raw, fut = _average(buffer, state.process_group, world)
    elif state.tuner is None:
        raw, fut = _compress(state, bucket, state.compressor, False)
    else:
        tuner, iteration, issued = state.tuner, state.iter, time.perf_counter()
        if not tuner.bound:  # once: two_levels waits for the group's queued collectives
            tuner.bind(two_levels(state.process_group))
        option = tuner.option(iteration, index)
        raw, fut = _compress(state, bucket, option.compressor, option.flat)
        if tuner.timed(iteration) and buffer.device.type == "cpu":  # the cost model's data (ddlcomm.adaptive)
            def arrived(f: torch.futures.Future) -> torch.Tensor:
                tuner.transferred(iteration, index, nbytes, issued, time.perf_counter())
                return f.value()

            fut = fut.then(arrived)
    if last:
        state.memory.end_iteration()
    return _end_bucket(state, raw, fut, last)


def _average(buffer: torch.Tensor, group: Optional[dist.ProcessGroup],
             world: int) -> tuple[torch.futures.Future, torch.futures.Future]:
    """A plain all-reduce of ``buffer``, averaged: with AVG on a ddlcomm group (each rank divides
    only the chunk it reduces: one pass over the bucket fewer than dividing the sum),
    else the sum divided (gloo has no AVG)."""
    if buffer.device.type == "cpu" and native_backend(group) is not None:
        raw = dist.all_reduce(buffer, op=dist.ReduceOp.AVG, group=group, async_op=True).get_future()
        return raw, raw.then(lambda f: f.value()[0])
    raw = dist.all_reduce(buffer, group=group, async_op=True).get_future()
    return raw, raw.then(lambda f: f.value()[0].div_(world))


def _uncompressed_reason(state: CompressionState, buffer: torch.Tensor, nbytes: int) -> Optional[str]:
    """Why a bucket goes as a plain all-reduce of its gradient, or None when it goes through
    ``_compress``."""
    if state.iter < state.start_compress_iter:
        return "warm-up"
    if buffer.is_cuda and not has_cuda():
        state.log_once("device", "ddlcomm hook: buckets on %s go uncompressed: this build of ddlcomm has no CUDA "
                        "kernels (it was built against a CPU-only torch)", buffer.device)
        return "device"
    if buffer.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        state.log_once("dtype", "ddlcomm hook: %s buckets go uncompressed: the compressors take float32, float16 "
                        "and bfloat16", buffer.dtype)
        return "dtype"
    if nbytes < state.min_compression_bytes:
        state.log_once("small", "ddlcomm hook: buckets smaller than min_compression_bytes=%d go uncompressed "
                        "(the first had %d bytes); lower it to compress them", state.min_compression_bytes, nbytes)
        return "small"
    return None


def _end_bucket(state: CompressionState, raw: torch.futures.Future, fut: torch.futures.Future,
                last: bool) -> torch.futures.Future:
    """Counts the iteration; at its last bucket waits for all of its communication, so that a
    failure raises its own exception (DistBackendError) from the hook: torch would report it
    through ``Future.then`` as a RuntimeError. DDP waits for every bucket right after the last
    one, so nothing is lost by waiting here."""
    state.iterations.sent(raw)
    if last:
        state.iterations.end()
    return fut


def _compress(state: CompressionState, bucket: _Bucket, compressor: Optional[Compressor], flat: bool
              ) -> tuple[torch.futures.Future, torch.futures.Future]:
    """A bucket through ``compressor`` (None: exactly, with what the error-feedback memory holds
    added, as the adaptive choice sends it), in one level over hosts if ``flat`` (an adaptive
    choice on a group that takes two), its update directions with ``optimizer=``."""
    buffer, params, signature, index, nbytes = bucket
    rank, world = state.rank_and_world()
    if state.optimizer is None and state.dgc is None and not isinstance(state.compressor, (FP16, BF16)):
        state.log_once("advice", "ddlcomm hook: compressing gradients with %r and no optimizer=: with momentum SGD "
                        "or Adam this loses accuracy; pass optimizer=ddlcomm.optim.SGD/Adam/AdamW(...) to average "
                        "update directions instead (docs/choosing-a-compressor.md)", state.compressor)
    worker = server = velocity = None
    sparse = compressor is not None and compressor.is_sparse
    # Server residuals are placed by the plan of a quantizer or cast (sparse formats keep none).
    placement = compressor if compressor is not None and not sparse else BF16()
    if state.error_feedback:
        worker, server, velocity = state.memory.buffers(signature, rank, world, state.dgc is not None and sparse,
                                                        buffer.device, state.process_group, placement, flat)
    if state.dgc is not None:  # local clipping, before the velocity accumulates
        state.dgc.clip(buffer, world)
    directions = state.averages_directions
    if directions:  # FP16 and BF16 only round: they average the gradient (averages_directions)
        state.optimizer.directions_for(params, _gradients(buffer, params), compressor, world)
    if velocity is not None:
        state.dgc.accumulate(buffer, velocity, worker)
    if worker is not None:  # memory made by the other plan goes now, whole
        state.memory.follow_plan(signature, buffer, flat, rank, world, state.process_group, placement)
    if compressor is None:
        if worker is not None:  # everything the memory holds goes now
            state.memory.send_whole(signature, buffer, rank, world, state.process_group, placement)
        ring = ring_all_reduce_bytes(nbytes, world)
        state.stats.count(ring, ring, compressed=False)
        raw, fut = _average(buffer, state.process_group, world)
    else:
        state.memory.emptied.discard(signature)
        state.stats.count(wire_bytes(compressor, buffer.numel(), world, rank), ring_all_reduce_bytes(nbytes, world),
                          compressed=True)
        route = route_of(buffer, compressor, state.process_group, flat)  # kept per group and compressor
        # DDP has checked that every rank has the same buckets; each compressor is checked once.
        if (signature, repr(compressor)) not in state._verified:
            check_agreement(buffer, compressor, state.process_group)
            state._verified.add((signature, repr(compressor)))
        # One C++ call (collective_compressed.cc), back at once with the bucket in flight.
        raw = route.start(buffer, worker, server, True, call_stream(state.iter, index)).get_future()
        fut = raw.then(lambda f: f.value()[0])
    if directions:
        optimizer = state.optimizer

        def arrived(f: torch.futures.Future) -> torch.Tensor:
            optimizer.averaged(params, _gradients(f.value(), params))
            return f.value()

        fut = fut.then(arrived)
    return raw, fut


def _gradients(buffer: torch.Tensor, params: list[torch.Tensor]) -> list[torch.Tensor]:
    """Views of the bucket's flat buffer, one per parameter, in the bucket's order."""
    if sum(p.numel() for p in params) != buffer.numel():
        raise RuntimeError(f"ddlcomm hook: a bucket of {buffer.numel()} elements holds parameters of "
                           f"{sum(p.numel() for p in params)}; cannot map its gradients to the optimizer")
    views, offset = [], 0
    for p in params:
        views.append(buffer[offset : offset + p.numel()].view_as(p))
        offset += p.numel()
    return views


