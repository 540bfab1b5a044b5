"""Low-communication training: rare, compressed outer steps (the DiLoCo family).

Every rank trains its own replica of the model with any torch optimizer (the inner steps: no
DDP, no communication). Every ``sync_every`` inner steps the ranks average their
pseudo-gradient, the global weights minus the local ones, through a ``ddlcomm.compressors``
compressor with error feedback, and an outer optimizer (Nesterov SGD, as DiLoCo,
arXiv 2311.08105) applies it to the global weights, which every replica then takes.

    model = Net()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    diloco = DiLoCo(model, inner, sync_every=50, compressor=Ternary())
    for x, y in data:
        loss_fn(model(x), y).backward()
        inner.step()
        inner.zero_grad()
        diloco.step()              # every 50th call averages and takes the outer step

The compressed average is bitwise the same on every rank (``ddlcomm.compressed``), so the
replicas are bitwise equal after every outer step. The residual each rank keeps carries what
compression left out into the next outer step (with ``outer_momentum=0`` the only memory, as
SparseLoCo, arXiv 2508.15706). Floating-point buffers of the model's ``state_dict``
(BatchNorm's statistics) are averaged exactly with the first fragment; non-persistent ones are
left alone. The constructor's options, each described in docs/diloco.md:

* ``fragments=F``, ``overlap_steps=d``: Streaming DiLoCo (arXiv 2501.18512): F contiguous parts
  take their outer steps in turn, and each average travels while the next d inner steps run;
  the replica keeps what those steps added (``local = global + (local - local_at_send)``).
* ``warmup_steps=N`` (post-local SGD, arXiv 1808.07217): the first N inner steps average the
  gradients as DDP would (a step pre-hook on the inner optimizer), exactly or through
  ``warmup_compressor``; a step that one rank skips (GradScaler) is skipped by every rank.
* ``replica_group=`` (``ddlcomm.replicas.replica_groups``): several ranks train one replica
  with DDP, and each syncs its 1/L of the pseudo-gradient with its peers in the other
  replicas, so that every rank of a host shares the outer traffic.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch
import torch.distributed as dist

from .compressed import compressed_all_reduce
from .compressors import BF16, FP16, Compressor, OneBit, TopK, all_finite
from .fragments import Fragment, InFlight, split
from .model_buffers import ModelBuffers
from .optim import averages_directions
from .options import CompressionStats
from .replicas import check_parts
from .wire import ring_all_reduce_bytes

__all__ = ["DiLoCo"]

logger = logging.getLogger(__name__)

_STATE_VERSION = 3  # 2: fragments, overlap_steps and the syncs in flight; 3: their buffers


class DiLoCo:
    """Outer steps over the replicas of ``model`` (see the module docs).

    Args:
        model: this rank's replica (not wrapped in DDP). Its parameters are broadcast from
            rank 0 here, so every replica starts from the same weights.
        inner_optimizer: the optimizer of the inner steps; ``step()`` only counts its steps.
        sync_every: inner steps between outer steps (DiLoCo's H).
        compressor: how the pseudo-gradient travels; None sends float32 (a plain all-reduce).
        outer_lr, outer_momentum, nesterov: the outer ``torch.optim.SGD``. The defaults, 1.0
            and 0.5 with Nesterov, held best across the recipes of docs/results/outer_steps
            (DiLoCo's published 0.7 and 0.9 come from runs of thousands of steps, and lost
            most on these; docs/diloco.md, "Outer learning rate and momentum").
        error_feedback: keep what the compressor left out for the next outer step.
        fragments: parts of the model that sync at staggered steps (Streaming DiLoCo; 1: the
            whole model at once).
        overlap_steps: inner steps a fragment's average may travel before it is applied
            (0: ``step()`` waits for it; less than ``sync_every``).
        warmup_steps: the first inner steps, each on the replicas' average gradient (see the
            module docs; 0: outer steps from the start).
        warmup_compressor: how the warm-up's gradients travel; None sends float32 (DDP's
            arithmetic).
        process_group: the group of replicas (default: the world); with ``replica_group``,
            the ranks that hold this rank's index in every replica.
        replica_group: the ranks that train this rank's replica together (their parameters
            equal after every inner step, as DDP keeps them); None: this rank alone.

    Attributes:
        outer_optimizer: the ``torch.optim.SGD`` over the global weights.
        stats: bytes this rank sent, against a plain ring all-reduce of the gradient at
            every inner step (DDP in float32): ``stats.ratio`` is the traffic saved.
        fragment_parameters: the parameters of each fragment, in schedule order.
        inner_steps, outer_steps: counted by ``step()`` (an outer step per fragment).
        skipped_warmup_steps: warm-up steps that no rank took, because a rank did not run
            ``inner_optimizer.step()``.
    """

    def __init__(self, model: torch.nn.Module, inner_optimizer: torch.optim.Optimizer, *, sync_every: int = 100,
                 compressor: Optional[Compressor] = None, outer_lr: float = 1.0, outer_momentum: float = 0.5,
                 nesterov: bool = True, error_feedback: bool = True, fragments: int = 1, overlap_steps: int = 0,
                 warmup_steps: int = 0, warmup_compressor: Optional[Compressor] = None,
                 process_group: Optional[dist.ProcessGroup] = None,
                 replica_group: Optional[dist.ProcessGroup] = None) -> None:
        for name, value, low in (("sync_every", sync_every, 1), ("fragments", fragments, 1),
                                 ("overlap_steps", overlap_steps, 0), ("warmup_steps", warmup_steps, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        if overlap_steps >= sync_every:
            raise ValueError(f"overlap_steps ({overlap_steps}) must be less than sync_every ({sync_every}): a "
                             f"fragment's average must arrive before its next outer step")
        for name, value in (("compressor", compressor), ("warmup_compressor", warmup_compressor)):
            if value is not None and not isinstance(value, Compressor):
                raise TypeError(f"{name} must be a ddlcomm.compressors compressor or None, got {type(value).__name__}")
        if replica_group is not None and (fragments != 1 or overlap_steps != 0 or process_group is None):
            raise ValueError("DiLoCo: replica_group= needs process_group= (the ranks of this index in every "
                             "replica: replica_groups() makes both) and whole-model outer steps (fragments=1, "
                             "overlap_steps=0)")
        if not isinstance(inner_optimizer, torch.optim.Optimizer):
            raise TypeError(f"inner_optimizer must be a torch.optim.Optimizer, got {type(inner_optimizer).__name__}")
        self.model = model
        self.inner_optimizer = inner_optimizer
        self.sync_every = sync_every
        self.compressor = compressor
        self.error_feedback = error_feedback and compressor is not None
        self.process_group = process_group
        self._params = [p for p in model.parameters() if p.requires_grad]
        if not self._params:
            raise ValueError("DiLoCo: the model has no parameters that require gradients")
        if len({p.device for p in self._params}) != 1:
            raise ValueError("DiLoCo: the model's parameters must be on one device")
        if fragments > len(self._params):
            raise ValueError(f"DiLoCo: {fragments} fragments for {len(self._params)} parameters")
        self.overlap_steps = overlap_steps
        self.warmup_steps = warmup_steps
        self.warmup_compressor = warmup_compressor if warmup_steps else None
        self.replica_group = replica_group
        # (this rank's index in its replica, the replica's ranks): the part of the
        # pseudo-gradient it syncs
        self._part = ((dist.get_rank(replica_group), dist.get_world_size(replica_group)) if replica_group is not None
                      else (0, 1))
        self._buffers = ModelBuffers(model, replica_group)
        with torch.no_grad():
            if replica_group is not None:
                check_parts(self._part, process_group)
            for t in self._params + self._buffers.tensors:
                dist.broadcast(t, src=dist.get_global_rank(self._group(), 0), group=process_group)
                if replica_group is not None:
                    dist.broadcast(t, src=dist.get_global_rank(replica_group, 0), group=replica_group)
            # The global weights, in float32 whatever the replica's dtype: the outer step
            # accumulates small pseudo-gradients into them.
            self._globals = [p.detach().to(torch.float32, copy=True) for p in self._params]
        # foreach: Nesterov's look-ahead in place in the gradient (the average, used once)
        # rather than a model-sized temporary at every outer step.
        self.outer_optimizer = torch.optim.SGD(self._globals, lr=outer_lr, momentum=outer_momentum,
                                               nesterov=nesterov and outer_momentum > 0, foreach=True)
        rank, n = dist.get_rank(self._group()), dist.get_world_size(self._group())
        sizes = [p.numel() for p in self._params]
        self._fragments = split(sizes, fragments, sync_every, self._part[1], rank, n, compressor,
                                self.warmup_compressor)
        synced = self._fragments[-1].end  # elements this rank syncs: all, or its part
        # One flat residual each, the fragments' in order (one fragment: the same layout as
        # a single compressed all-reduce of every parameter).
        self._worker, self._server = self._residuals(compressor if self.error_feedback else None, synced)
        # The warm-up's gradients keep their own memory: it is in gradient units, the outer
        # residuals in weight units. Freed when the warm-up ends.
        self._warm_feedback = self.warmup_compressor if error_feedback else None
        self._warm_worker, self._warm_server = self._residuals(self._warm_feedback, synced)
        self.fragment_parameters = [self._params[f.first:f.last] for f in self._fragments]
        # Each fragment's pseudo-gradient (then its average), and with overlap the replica's
        # part when it was sent, in buffers kept between syncs: a fresh model-sized tensor
        # costs several copies' time in page faults on a CPU (the CNN of docs/diloco.md). A
        # fragment's next sync starts after its last was applied (overlap < sync_every).
        device = self._params[0].device
        self._sends = [torch.zeros(self._part[1] * (f.end - f.begin), device=device) for f in self._fragments]
        self._snapshots = [torch.zeros(f.end - f.begin, device=device) if overlap_steps else None
                           for f in self._fragments]
        self._in_flight: list[InFlight] = []
        self._plain_bytes = ring_all_reduce_bytes(synced * 4, n)  # DDP's float32 all-reduce (of this part)
        self.stats = CompressionStats()
        self.inner_steps = 0
        self.outer_steps = 0
        self._averaged = 0  # warm-up steps whose gradients the pre-hook averaged (or dropped)
        self._skipped_at = 0  # the last warm-up step no rank took
        self.skipped_warmup_steps = 0
        if isinstance(compressor, (OneBit, TopK)):
            logger.warning(
                "DiLoCo: outer steps through %r ended further above DDP's loss than through Ternary() on the "
                "transformer of docs/results/diloco.md (top-k at 5%% too: docs/results/diloco_topk); consider "
                "Ternary()", compressor)
        if isinstance(inner_optimizer, (torch.optim.Adam, torch.optim.AdamW)):
            logger.warning(
                "DiLoCo: outer steps over replicas trained with %s missed DDP's loss by more than 2%% on the "
                "transformer of docs/results/outer_steps (+2.1%% to +2.3%% with the default outer settings, float32 "
                "and ternary; +1.9%% or more at every setting tried) and lost 0.65-0.73 points of its CNN's accuracy; "
                "a 10-step warm-up through the outer compressor (warmup_steps=10, warmup_compressor=Ternary()) "
                "brought both to +1.7%% and -0.42 (docs/diloco.md, \"What to try first\")",
                type(inner_optimizer).__name__)
        if warmup_steps:
            self._hook = inner_optimizer.register_step_pre_hook(self._average_gradients)
            if not isinstance(warmup_compressor, (type(None), FP16, BF16)) and \
                    not averages_directions(inner_optimizer, warmup_compressor):
                logger.warning(
                    "DiLoCo: a warm-up through %r with a torch optimizer compresses gradients, which momentum and "
                    "Adam amplify (docs/diloco.md, \"The CNN: a warm-up, then outer steps\"); use a "
                    "ddlcomm.optim optimizer, whose update directions it then averages", warmup_compressor)

    def _residuals(self, compressor: Optional[Compressor], synced: int
                   ) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """Zero (worker, server) error-feedback residuals for ``compressor`` (None: none)."""
        if compressor is None:
            return None, None
        device = self._params[0].device
        server = None if compressor.is_sparse else torch.zeros(self._fragments[-1].server.stop, device=device)
        return torch.zeros(synced, device=device), server

    def _group(self) -> dist.ProcessGroup:
        return self.process_group or dist.group.WORLD

    def step(self) -> bool:
        """Counts an inner step (call it after ``inner_optimizer.step()``): applies the averages
        due now and starts the syncs this step begins (every ``sync_every``-th call for the
        whole model, staggered with ``fragments``; during the warm-up the global weights follow
        the replicas). Returns whether the global weights changed."""
        self.inner_steps += 1
        self.stats.bytes_uncompressed += self._plain_bytes
        if self.inner_steps <= self.warmup_steps:  # nothing is in flight: no overlap before the schedule
            if self._averaged != self.inner_steps:  # inner_optimizer.step() did not run on this rank
                self._skip(self._warmup_skips(stepping=False), self.inner_steps)
                self._averaged = self.inner_steps
            took = self._skipped_at != self.inner_steps
            if took:
                with torch.no_grad():
                    for g, p in zip(self._globals, self._params):
                        g.copy_(p)
            if self.inner_steps == self.warmup_steps:
                self._hook.remove()
                self._warm_worker = self._warm_server = None
            return took
        applied = self._finish(lambda flight: flight.due <= self.inner_steps)
        for fragment in self._fragments:
            if self.inner_steps % self.sync_every == fragment.phase:
                self._start(fragment, self.overlap_steps)
                applied |= self._finish(lambda flight: flight.due <= self.inner_steps)
        return applied

    @torch.no_grad()
    def sync(self) -> None:
        """Every fragment's outer step now (after those in flight): the replica ends on the
        global weights."""
        self._finish(lambda flight: True)
        for fragment in self._fragments:
            self._start(fragment, 0)
            self._finish(lambda flight: True)

    def _slice(self, fragment: Fragment) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return self._globals[fragment.first:fragment.last], self._params[fragment.first:fragment.last]

    @torch.no_grad()
    def _average_gradients(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """The inner optimizer's step pre-hook: during the warm-up, the replicas' mean gradient
        (or with a ``ddlcomm.optim`` optimizer, update direction) and BatchNorm's statistics in
        place of this rank's."""
        # Once per step: a subclass's step() that calls super().step() runs the hooks again.
        if self.inner_steps >= self.warmup_steps or self._averaged > self.inner_steps:
            return
        self._averaged = self.inner_steps + 1
        skipping = self._warmup_skips(stepping=True)
        if skipping:  # the step does nothing here either: torch optimizers pass over a None .grad
            self._skip(skipping, self.inner_steps + 1)
            for group in optimizer.param_groups:
                for p in group["params"]:
                    p.grad = None
            return
        directions = averages_directions(optimizer, self.warmup_compressor)
        if directions:  # every parameter takes the average direction, as every one is sent
            for p in self._params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            optimizer.directions_for(self._params, [p.grad for p in self._params], self.warmup_compressor,
                                     dist.get_world_size(self._group()))
        for fragment in self._fragments:
            self._start(fragment, 0, gradient=True)
            self._finish(lambda flight: True)
        if directions:
            optimizer.averaged(self._params, [p.grad for p in self._params])

    def _warmup_skips(self, stepping: bool) -> list[int]:
        """The ranks of the group that do not run ``inner_optimizer.step()`` at this warm-up
        step, the same list on every rank (one all-reduce of a flag per rank, before any average)."""
        group = self._group()
        flags = torch.zeros(dist.get_world_size(group), dtype=torch.int32, device=self._params[0].device)
        flags[dist.get_rank(group)] = 0 if stepping else 1
        dist.all_reduce(flags, group=group)
        return [dist.get_global_rank(group, i) for i in flags.nonzero().flatten().tolist()]

    @torch.no_grad()
    def _skip(self, ranks: list[int], step: int) -> None:
        """Marks warm-up step ``step`` (counted from 1) as taken by no rank; BatchNorm's
        statistics, which its forward pass moved, are still averaged."""
        self._skipped_at = step
        self.skipped_warmup_steps += 1
        if self._buffers:
            average = self._buffers.flat()
            dist.all_reduce(average, group=self._group())
            self._buffers.set(average.div_(dist.get_world_size(self._group())))
        if self.skipped_warmup_steps == 1:
            logger.warning(
                "DiLoCo: warm-up step %d taken by no rank: rank(s) %s did not run inner_optimizer.step() (a GradScaler "
                "that found inf skips it); the others dropped its gradients (logged once)", step,
                ", ".join(map(str, ranks)))

    @torch.no_grad()
    def _start(self, fragment: Fragment, overlap: int, gradient: bool = False) -> None:
        """Sends the fragment's pseudo-gradient (global minus local weights), or in the warm-up
        its gradient, to be averaged."""
        globals_, params = self._slice(fragment)
        delta, snapshot = self._sends[fragment.index], self._snapshots[fragment.index] if overlap else None
        offset = 0
        for g, p in zip(globals_, params):
            view = delta[offset : offset + p.numel()]
            if not gradient:  # global minus replica
                torch.sub(g.reshape(-1), view.copy_(p.detach().reshape(-1)), out=view)
            elif p.grad is None:  # zero, as DDP sends for an unused parameter
                view.zero_()
            else:
                view.copy_(p.grad.reshape(-1))
            if snapshot is not None:
                snapshot[offset : offset + p.numel()].copy_(p.detach().reshape(-1))
            offset += p.numel()
        delta[offset:].zero_()  # with parts: the padding to equal parts
        group = self._group()
        index, parts = self._part
        part = delta.view(parts, -1)[index]
        compressor = self.warmup_compressor if gradient else self.compressor
        if compressor is None:
            future = dist.all_reduce(part, group=group, async_op=True)
        else:
            # Its own randomness per fragment and sync (one fragment: the outer step's number);
            # the warm-up's streams lie past any outer step's.
            syncs = self.inner_steps + (1 << 40) if gradient else fragment.syncs
            worker, server = (self._warm_worker, self._warm_server) if gradient else (self._worker, self._server)
            worker = None if worker is None else worker[fragment.begin:fragment.end]
            server = None if server is None else server[fragment.server]
            future = compressed_all_reduce(part, compressor, worker, server, group=self.process_group, average=True,
                                           stream=syncs * len(self._fragments) + fragment.index)
        fragment.syncs += not gradient
        self.stats.bytes_sent += fragment.warmup_bytes if gradient else fragment.sent_bytes
        flight = InFlight(fragment, self.inner_steps + overlap, delta, snapshot, future, gradient)
        if fragment.index == 0 and self._buffers:
            # Exact, in one all-reduce that travels with the fragment (and overlaps as it does).
            flight.buffers = self._buffers.flat()
            flight.buffers_snapshot = flight.buffers.clone() if overlap else None
            flight.buffers_work = dist.all_reduce(flight.buffers, group=group, async_op=True)
        self._in_flight.append(flight)

    def _wait(self, flight: InFlight) -> torch.Tensor:
        """The fragment's average (waiting for it once; with parts, gathered in the replica)."""
        if flight.future is not None:
            flight.future.wait()
            flight.future = None
            index, parts = self._part
            rows = flight.delta.view(parts, -1)
            if (self.warmup_compressor if flight.gradient else self.compressor) is None:
                rows[index].div_(dist.get_world_size(self._group()))
            if parts > 1:
                dist.all_gather(list(rows), rows[index].clone(), group=self.replica_group)
                numel = sum(g.numel() for g in self._slice(flight.fragment)[0])
                flight.delta = flight.delta[:numel]
        if flight.buffers_work is not None:
            flight.buffers_work.wait()
            flight.buffers_work = None
            flight.buffers.div_(dist.get_world_size(self._group()))
        return flight.delta

    @torch.no_grad()
    def _finish(self, due) -> bool:
        """Applies the averages in flight that ``due`` selects, in the order they were sent."""
        ready = [flight for flight in self._in_flight if due(flight)]
        self._in_flight = [flight for flight in self._in_flight if not due(flight)]
        for flight in ready:
            self._apply(flight)
        return bool(ready)

    def _apply(self, flight: InFlight) -> None:
        delta, fragment, group = self._wait(flight), flight.fragment, self._group()
        globals_, params = self._slice(fragment)
        if flight.gradient:  # the inner optimizer steps with the average (non-finite: as with DDP)
            offset = 0
            for p in params:  # copied: the buffer is the next sync's, and .grad the user's
                average = delta[offset : offset + p.numel()].view_as(p)
                if p.grad is None:
                    p.grad = average.to(p.dtype, copy=True)
                else:
                    p.grad.copy_(average)
                offset += p.numel()
            self._take_buffers(flight)
            return
        if not all_finite(delta):
            # The average is the same on every rank, so every rank raises here.
            raise RuntimeError(f"DiLoCo: the averaged pseudo-gradient of outer step {self.outer_steps} is not finite "
                               f"(rank {dist.get_rank(group)}); the global weights were left unchanged")
        offset = 0
        for g in globals_:
            g.grad = delta[offset : offset + g.numel()].view_as(g)
            offset += g.numel()
        self.outer_optimizer.step()  # the parameters without a gradient (other fragments) stay
        offset = 0
        for g, p in zip(globals_, params):
            if flight.snapshot is None:
                p.copy_(g)
            else:  # keep what the inner steps added while the average travelled (in place: the
                # snapshot is used once)
                since = flight.snapshot[offset : offset + p.numel()].view_as(p).neg_().add_(p.detach())
                p.copy_(since.add_(g))
            offset += p.numel()
            g.grad = None
        self._take_buffers(flight)
        self.outer_steps += 1

    def _take_buffers(self, flight: InFlight) -> None:
        """BatchNorm's statistics, the first fragment's flight's average (plus, sent earlier,
        what this replica's steps changed since)."""
        if flight.buffers is not None:
            self._buffers.set(flight.buffers, flight.buffers_snapshot)

    def state_dict(self) -> dict[str, Any]:
        """What this rank needs to resume exactly: the global weights, the outer optimizer, the
        error-feedback residuals, the step counts and statistics. Save the model and the inner
        optimizer beside it; each rank saves its own (the residuals differ)."""
        return {
            "version": _STATE_VERSION,
            "rank": dist.get_rank(self._group()),
            "world_size": dist.get_world_size(self._group()),
            "sync_every": self.sync_every,
            "fragments": len(self._fragments),
            "overlap_steps": self.overlap_steps,
            "warmup_steps": self.warmup_steps,
            "part": self._part,
            "fragment_syncs": [f.syncs for f in self._fragments],
            "in_flight": [{"fragment": f.fragment.index, "due": f.due, "average": self._wait(f).clone(),
                           "snapshot": _copy(f.snapshot), "buffers": _copy(f.buffers),
                           "buffers_snapshot": _copy(f.buffers_snapshot)} for f in self._in_flight],
            "inner_steps": self.inner_steps,
            "outer_steps": self.outer_steps,
            "globals": [g.clone() for g in self._globals],
            "outer_optimizer": self.outer_optimizer.state_dict(),
            "worker_residual": None if self._worker is None else self._worker.clone(),
            "server_residual": None if self._server is None else self._server.clone(),
            "warmup_worker_residual": None if self._warm_worker is None else self._warm_worker.clone(),
            "warmup_server_residual": None if self._warm_server is None else self._warm_server.clone(),
            "stats": vars(self.stats).copy(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores what ``state_dict`` returned on this rank; ValueError for another rank,
        world size, schedule or model."""
        if int(state.get("version", 0)) != _STATE_VERSION:
            raise ValueError(f"DiLoCo: state version {state.get('version')!r}, expected {_STATE_VERSION}")
        here = (dist.get_rank(self._group()), dist.get_world_size(self._group()), self.sync_every,
                len(self._fragments), self.overlap_steps, self.warmup_steps, tuple(self._part))
        saved = (state["rank"], state["world_size"], state["sync_every"], state["fragments"], state["overlap_steps"],
                 state.get("warmup_steps", 0), tuple(state.get("part", (0, 1))))
        if here != saved:
            raise ValueError(f"DiLoCo: state saved as (rank, world size, sync_every, fragments, overlap_steps, "
                             f"warmup_steps, (index in the replica, its ranks)) {saved}, loaded as {here}")
        shapes = [g.shape for g in self._globals]
        if [g.shape for g in state["globals"]] != shapes:
            raise ValueError("DiLoCo: the saved global weights do not match this model's parameters")
        warming = int(state["inner_steps"]) < self.warmup_steps
        self._warm_worker, self._warm_server = (  # as this object's own warm-up leaves them
            self._residuals(self._warm_feedback, self._fragments[-1].end) if warming else (None, None))
        for name, mine in (("worker_residual", self._worker), ("server_residual", self._server),
                           ("warmup_worker_residual", self._warm_worker),
                           ("warmup_server_residual", self._warm_server)):
            theirs = state.get(name)
            if name.startswith("warmup") and not warming:
                continue  # the warm-up's memory is not needed after it (saved by a version that kept it)
            if (mine is None) != (theirs is None) or (mine is not None and mine.shape != theirs.shape):
                raise ValueError(f"DiLoCo: the saved {name} does not match this compressor and model")
            if mine is not None:
                mine.copy_(theirs)
        for g, saved_g in zip(self._globals, state["globals"]):
            g.copy_(saved_g)
        self.outer_optimizer.load_state_dict(state["outer_optimizer"])
        self.inner_steps, self.outer_steps = int(state["inner_steps"]), int(state["outer_steps"])
        for fragment, syncs in zip(self._fragments, state["fragment_syncs"]):
            fragment.syncs = int(syncs)
        self._in_flight = [InFlight(self._fragments[f["fragment"]], int(f["due"]), f["average"].clone(),
                                     _copy(f["snapshot"]), None, buffers=_copy(f["buffers"]),
                                     buffers_snapshot=_copy(f["buffers_snapshot"]))
                           for f in state["in_flight"]]
        self.stats = CompressionStats(**state["stats"])
        if self.warmup_steps:  # again, should this object have finished its own warm-up
            self._hook.remove()
            self._hook = self.inner_optimizer.register_step_pre_hook(self._average_gradients)


def _copy(tensor: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if tensor is None else tensor.clone()
