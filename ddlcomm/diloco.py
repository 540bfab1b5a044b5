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
compression left out into the next outer step; with ``outer_momentum=0`` that memory is the
only one, as SparseLoCo (arXiv 2508.15706) uses it. Floating-point buffers (BatchNorm's
running statistics) are averaged uncompressed at each outer step.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from .compressed import compressed_all_reduce, server_residual_numel, wire_bytes
from .compressors import Compressor
from .options import CompressionStats
from .wire import ring_all_reduce_bytes

__all__ = ["DiLoCo"]

_STATE_VERSION = 1


class DiLoCo:
    """Outer steps over the replicas of ``model`` (see the module docs).

    Args:
        model: this rank's replica (not wrapped in DDP). Its parameters are broadcast from
            rank 0 here, so every replica starts from the same weights.
        inner_optimizer: the optimizer of the inner steps; ``step()`` only counts its steps.
        sync_every: inner steps between outer steps (DiLoCo's H).
        compressor: how the pseudo-gradient travels; None sends float32 (a plain all-reduce).
        outer_lr, outer_momentum, nesterov: the outer ``torch.optim.SGD`` (DiLoCo: 0.7, 0.9,
            Nesterov).
        error_feedback: keep what the compressor left out for the next outer step.
        process_group: the group of replicas (default: the world).

    Attributes:
        outer_optimizer: the ``torch.optim.SGD`` over the global weights.
        stats: bytes this rank sent, against a plain ring all-reduce of the gradient at
            every inner step (DDP in float32): ``stats.ratio`` is the traffic saved.
        inner_steps, outer_steps: counted by ``step()``.
    """

    def __init__(self, model: torch.nn.Module, inner_optimizer: torch.optim.Optimizer, *, sync_every: int = 100,
                 compressor: Optional[Compressor] = None, outer_lr: float = 0.7, outer_momentum: float = 0.9,
                 nesterov: bool = True, error_feedback: bool = True,
                 process_group: Optional[dist.ProcessGroup] = None) -> None:
        if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
            raise ValueError(f"sync_every must be a positive integer, got {sync_every!r}")
        if compressor is not None and not isinstance(compressor, Compressor):
            raise TypeError(f"compressor must be a ddlcomm.compressors compressor or None, got "
                            f"{type(compressor).__name__}")
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
        self._buffers = [b for b in model.buffers() if b.is_floating_point()]
        with torch.no_grad():
            for t in self._params + self._buffers:
                dist.broadcast(t, src=dist.get_global_rank(self._group(), 0), group=process_group)
            # The global weights, in float32 whatever the replica's dtype: the outer step
            # accumulates small pseudo-gradients into them.
            self._globals = [p.detach().to(torch.float32, copy=True) for p in self._params]
        self.outer_optimizer = torch.optim.SGD(self._globals, lr=outer_lr, momentum=outer_momentum,
                                               nesterov=nesterov and outer_momentum > 0)
        numel = sum(p.numel() for p in self._params)
        rank, n = dist.get_rank(self._group()), dist.get_world_size(self._group())
        device = self._params[0].device
        self._worker = torch.zeros(numel, device=device) if self.error_feedback else None
        sparse = compressor is not None and compressor.is_sparse
        self._server = (torch.zeros(server_residual_numel(numel, rank, n), device=device)
                        if self.error_feedback and not sparse else None)
        self._plain_bytes = ring_all_reduce_bytes(numel * 4, n)  # DDP's float32 all-reduce
        self._sent_bytes = wire_bytes(compressor, numel, n, rank) if compressor is not None else self._plain_bytes
        self.stats = CompressionStats()
        self.inner_steps = 0
        self.outer_steps = 0

    def _group(self) -> dist.ProcessGroup:
        return self.process_group or dist.group.WORLD

    def step(self) -> bool:
        """Counts an inner step (call it after ``inner_optimizer.step()``); every
        ``sync_every``-th call takes the outer step. Returns whether it did."""
        self.inner_steps += 1
        self.stats.bytes_uncompressed += self._plain_bytes
        if self.inner_steps % self.sync_every:
            return False
        self.sync()
        return True

    @torch.no_grad()
    def sync(self) -> None:
        """The outer step now: average the pseudo-gradient, step the global weights, and set
        the replica to them."""
        delta = torch.cat([(g - p.to(torch.float32)).reshape(-1) for g, p in zip(self._globals, self._params)])
        group = self._group()
        if self.compressor is None:
            dist.all_reduce(delta, group=group)
            delta.div_(dist.get_world_size(group))
        else:
            compressed_all_reduce(delta, self.compressor, self._worker, self._server, group=self.process_group,
                                  average=True, stream=self.outer_steps).wait()
        self.stats.bytes_sent += self._sent_bytes
        if not bool(torch.isfinite(delta).all()):
            # The average is the same on every rank, so every rank raises here.
            raise RuntimeError(f"DiLoCo: the averaged pseudo-gradient of outer step {self.outer_steps} is not finite "
                               f"(rank {dist.get_rank(group)}); the global weights were left unchanged")
        offset = 0
        for g in self._globals:
            g.grad = delta[offset : offset + g.numel()].view_as(g)
            offset += g.numel()
        self.outer_optimizer.step()
        for g, p in zip(self._globals, self._params):
            p.copy_(g)
            g.grad = None
        for b in self._buffers:
            dist.all_reduce(b, group=group)
            b.div_(dist.get_world_size(group))
        self.outer_steps += 1

    def state_dict(self) -> dict[str, Any]:
        """What this rank needs to resume exactly: the global weights, the outer optimizer, the
        error-feedback residuals, the step counts and statistics. Save the model and the inner
        optimizer beside it; each rank saves its own (the residuals differ)."""
        return {
            "version": _STATE_VERSION,
            "rank": dist.get_rank(self._group()),
            "world_size": dist.get_world_size(self._group()),
            "sync_every": self.sync_every,
            "inner_steps": self.inner_steps,
            "outer_steps": self.outer_steps,
            "globals": [g.clone() for g in self._globals],
            "outer_optimizer": self.outer_optimizer.state_dict(),
            "worker_residual": None if self._worker is None else self._worker.clone(),
            "server_residual": None if self._server is None else self._server.clone(),
            "stats": vars(self.stats).copy(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores what ``state_dict`` returned on this rank; ValueError for another rank,
        world size, schedule or model."""
        if int(state.get("version", 0)) != _STATE_VERSION:
            raise ValueError(f"DiLoCo: state version {state.get('version')!r}, expected {_STATE_VERSION}")
        here = (dist.get_rank(self._group()), dist.get_world_size(self._group()), self.sync_every)
        saved = (state["rank"], state["world_size"], state["sync_every"])
        if here != saved:
            raise ValueError(f"DiLoCo: state saved as (rank, world size, sync_every) {saved}, loaded as {here}")
        shapes = [g.shape for g in self._globals]
        if [g.shape for g in state["globals"]] != shapes:
            raise ValueError("DiLoCo: the saved global weights do not match this model's parameters")
        for name, mine in (("worker_residual", self._worker), ("server_residual", self._server)):
            theirs = state[name]
            if (mine is None) != (theirs is None) or (mine is not None and mine.shape != theirs.shape):
                raise ValueError(f"DiLoCo: the saved {name} does not match this compressor and model")
            if mine is not None:
                mine.copy_(theirs)
        for g, saved_g in zip(self._globals, state["globals"]):
            g.copy_(saved_g)
        self.outer_optimizer.load_state_dict(state["outer_optimizer"])
        self.inner_steps, self.outer_steps = int(state["inner_steps"]), int(state["outer_steps"])
        self.stats = CompressionStats(**state["stats"])
