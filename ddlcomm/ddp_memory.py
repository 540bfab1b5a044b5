"""Error-feedback memory of a compressed DDP hook, keyed by the parameters it belongs to.

DDP groups parameters into buckets in one order for its first iteration and rebuilds them
after it; a fresh DDP after a restart starts with the first layout again, and a changed
``bucket_cap_mb`` gives another one. Memory keyed by bucket index would then be added to
other parameters' gradients. Here each bucket's memory is keyed by its *signature*: the keys
of its parameters, in the bucket's order (names from ``model.named_parameters()``, or
positions in the optimizer's ``param_groups``). A bucket whose signature is new takes its
memory from the old buckets parameter by parameter; a server residual (the error of the chunk
this rank reduced, in units of the averaged result) is folded into this rank's worker
residual, scaled by the world size, so the error it holds is sent next step instead of lost.

Over several hosts a bucket's memory also depends on the plan that made it: the group's two
levels place the server residual (and use the worker residual) at this rank's shard of the
host sum, the one-level plan an adaptive hook may choose at its chunks of the whole vector.
A bucket sent by the other plan than its memory's first sends all of it (``follow_plan``).
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch
import torch.distributed as dist

from .compressed import server_chunks, server_residual_numel
from .compressors import Compressor

__all__ = ["Signature", "FeedbackMemory", "ParameterKeys"]

logger = logging.getLogger("ddlcomm.hooks")

Signature = tuple[str, ...]
_KINDS = ("worker_residuals", "server_residuals", "momenta")


class ParameterKeys:
    """The keys the memory knows parameters by: the model's parameter names (DDP's and
    torch.compile's prefixes dropped), else positions in the optimizer's parameter groups, else
    names valid in this process only (which no checkpoint can carry: ``scheme`` says which)."""

    def __init__(self) -> None:
        self._of: dict[torch.Tensor, str] = {}

    @staticmethod
    def scheme(model: Optional[torch.nn.Module], optimizer: Optional[torch.optim.Optimizer]) -> str:
        """"names", "optimizer" or "process": what the keys are made of."""
        return "names" if model is not None else "optimizer" if optimizer is not None else "process"

    def signature(self, params: list[torch.Tensor], numel: int, index: int, model: Optional[torch.nn.Module],
                  optimizer: Optional[torch.optim.Optimizer]) -> tuple[Signature, list[int]]:
        """The keys of a bucket's parameters, and their sizes; a buffer that is not a DDP bucket
        (its parameters do not add up to it: a test double) is keyed by its index."""
        if sum(p.numel() for p in params) != numel:
            return (f"<bucket {index}>",), [numel]
        if any(p not in self._of for p in params):
            self._of = self._named(model, optimizer)
            for p in params:  # no model or optimizer to name it: valid in this process only
                self._of.setdefault(p, f"<parameter {len(self._of)}>")
        return tuple(self._of[p] for p in params), [p.numel() for p in params]

    def key(self, param: torch.Tensor) -> str:
        """The key of a parameter of a bucket seen before."""
        return self._of[param]

    def _named(self, model: Optional[torch.nn.Module], optimizer: Optional[torch.optim.Optimizer]
               ) -> dict[torch.Tensor, str]:
        if model is not None:
            keys = {}
            for name, p in model.named_parameters():
                while name.startswith(("module.", "_orig_mod.")):  # DDP and torch.compile wrappers
                    name = name.split(".", 1)[1]
                keys[p] = name
            return keys
        if optimizer is not None:
            params = [p for group in optimizer.param_groups for p in group["params"]]
            return {p: f"param_groups.{i}" for i, p in enumerate(params)}
        return dict(self._of)

    def __getstate__(self) -> dict[str, Any]:
        return {}  # parameters do not outlive their process: named again at the first bucket

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._of = {}


class FeedbackMemory:
    """Worker residuals, server residuals and DGC momenta of every compressed bucket.

    Attributes:
        worker_residuals, server_residuals, momenta: signature -> float32 tensor.
        numels: parameter key -> number of elements.
        layout: the signatures of the buckets of the last complete iteration, by bucket index.
        emptied: buckets whose memory holds nothing since ``send_whole`` (until a lossy send).
        flat: buckets whose memory was made by the one-level plan on a group that takes two
            (``ddlcomm.compressed.two_levels``); the others' by the group's plan.
    """

    def __init__(self) -> None:
        self.worker_residuals: dict[Signature, torch.Tensor] = {}
        self.server_residuals: dict[Signature, torch.Tensor] = {}
        self.momenta: dict[Signature, torch.Tensor] = {}
        self.numels: dict[str, int] = {}
        self.layout: list[Signature] = []
        self.emptied: set[Signature] = set()
        self.flat: set[Signature] = set()
        self._building: dict[int, Signature] = {}
        self._remapped = False
        self._logged_remap = False
        self._loaded_keys: Optional[set[str]] = None  # parameters of a loaded state, until its first iteration

    def __setstate__(self, state: dict[str, Any]) -> None:  # pickled before ``flat`` existed
        self.__dict__.update(state)
        self.__dict__.setdefault("flat", set())

    def __bool__(self) -> bool:
        return bool(self.worker_residuals or self.server_residuals or self.momenta)

    def note_bucket(self, index: int, signature: Signature, numels: list[int]) -> None:
        """Records a bucket of this iteration (before its ``buffers``)."""
        if self._loaded_keys is not None:
            wrong = [f"{k} ({n} elements)" for k, n in zip(signature, numels)
                     if k not in self._loaded_keys or self.numels[k] != n]
            if wrong:
                raise ValueError(f"ddlcomm hook: the loaded state has no parameters {wrong[:3]} (it has "
                                 f"{sorted(self._loaded_keys)[:3]}...): it was saved for another model")
        self._building[index] = signature
        self.numels.update(zip(signature, numels))

    def end_iteration(self) -> None:
        """After the last bucket: the iteration's layout becomes the layout; after a remap,
        every parameter's memory lives in a bucket of it, and the old buckets' is dropped."""
        self.layout = [self._building[i] for i in sorted(self._building)]
        self._building = {}
        self._loaded_keys = None
        if self._remapped:
            self._remapped = False
            current = set(self.layout)
            for kind in _KINDS:
                store = getattr(self, kind)
                for old in [s for s in store if s not in current]:
                    del store[old]
            self.flat &= current

    def buffers(
        self, signature: Signature, rank: int, world: int, momentum: bool, device: Optional[torch.device] = None,
        group: Optional[dist.ProcessGroup] = None, compressor: Optional[Compressor] = None, flat: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """(worker residual, server residual, momentum or None) of a bucket, made on first use
        on ``device`` (the bucket's; default CPU), where a loaded memory moves on first use.
        ``group`` and ``compressor`` say which plan placed the server residuals (server_chunks),
        ``flat`` that a new one is made for the one-level plan."""
        device = torch.device("cpu") if device is None else device
        self._move_to(device)
        numel = sum(self.numels[k] for k in signature)
        worker = self.worker_residuals.get(signature)
        if worker is None and any(not set(s).isdisjoint(signature) for s in self.worker_residuals):
            self._remap(signature, rank, world, group, compressor)
            worker = self.worker_residuals.get(signature)
        if worker is None:
            worker = self.worker_residuals[signature] = torch.zeros(numel, device=device)
        server = self.server_residuals.get(signature)
        if server is None:
            server = self.server_residuals[signature] = torch.zeros(server_residual_numel(numel, rank, world),
                                                                    device=device)
            self.flat.discard(signature)
            if flat:
                self.flat.add(signature)
        moment = None
        if momentum:
            moment = self.momenta.get(signature)
            if moment is None:
                moment = self.momenta[signature] = torch.zeros(numel, device=device)
        return worker, server, moment

    def send_whole(self, signature: Signature, buffer: torch.Tensor, rank: int, world: int,
                   group: Optional[dist.ProcessGroup], compressor: Optional[Compressor]) -> None:
        """Adds all a bucket's memory holds to ``buffer``, which an exact send then carries
        whole, and empties it: the server residual (placed by ``compressor``'s plan, as in
        ``buffers``) through the worker residual. Nothing to add while it stays empty."""
        if signature in self.emptied or signature not in self.worker_residuals:
            return
        worker, server = self.worker_residuals[signature], self.server_residuals.get(signature)
        _fold(worker, server, rank, world, group, compressor, signature in self.flat)
        buffer.add_(worker.view_as(buffer))
        worker.zero_()
        if server is not None:
            server.zero_()
        self.emptied.add(signature)

    def follow_plan(self, signature: Signature, buffer: torch.Tensor, flat: bool, rank: int, world: int,
                    group: Optional[dist.ProcessGroup], compressor: Optional[Compressor]) -> None:
        """Before a bucket is sent by the one-level plan (``flat``) or the group's: where its
        memory was made by the other, all of it goes into ``buffer`` (``send_whole``), and error
        feedback starts afresh in the places of the plan that sends it (the two plans keep their
        residuals at different places: nothing would send the old ones)."""
        if (signature in self.flat) == flat:
            return
        self.send_whole(signature, buffer, rank, world, group, compressor)
        self.flat ^= {signature}

    def _move_to(self, device: torch.device) -> None:
        """Every tensor of the memory onto ``device`` (a state loaded on the CPU for a GPU model)."""
        for kind in _KINDS:
            store = getattr(self, kind)
            for signature, tensor in store.items():
                if tensor.device != device:
                    store[signature] = tensor.to(device)

    def _remap(self, signature: Signature, rank: int, world: int, group: Optional[dist.ProcessGroup],
               compressor: Optional[Compressor]) -> None:
        """Builds the memory of a new bucket from the buckets that held its parameters."""
        worker_parts: dict[str, torch.Tensor] = {}
        momentum_parts: dict[str, torch.Tensor] = {}
        for old, residual in self.worker_residuals.items():
            if not set(old) & set(signature):
                continue
            residual = residual.clone()
            _fold(residual, self.server_residuals.get(old), rank, world, group, compressor, old in self.flat)
            worker_parts.update(self._split(old, residual))
            if old in self.momenta:
                momentum_parts.update(self._split(old, self.momenta[old]))
        if not self._remapped and not self._logged_remap:
            self._logged_remap = True
            logger.warning("ddlcomm hook: the DDP bucket layout differs from the one the error-feedback memory was "
                           "made under (changed bucket_cap_mb, or a new model wrapper); remapping it parameter by "
                           "parameter, with the server residuals folded into the worker residuals")
        self._remapped = True

        def join(parts: dict[str, torch.Tensor]) -> torch.Tensor:
            device = next(iter(parts.values())).device if parts else None
            return torch.cat([parts[k] if k in parts else torch.zeros(self.numels[k], device=device)
                              for k in signature])

        self.worker_residuals[signature] = join(worker_parts)
        if momentum_parts:
            self.momenta[signature] = join(momentum_parts)

    def _split(self, signature: Signature, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        parts, at = {}, 0
        for key in signature:
            parts[key] = flat[at : at + self.numels[key]]
            at += self.numels[key]
        return parts

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {kind: {k: v.clone() for k, v in getattr(self, kind).items()} for kind in _KINDS}
        state["numels"] = dict(self.numels)
        state["layout"] = [list(s) for s in self.layout]
        state["flat"] = sorted(list(s) for s in self.flat)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        numels = {str(k): int(v) for k, v in state["numels"].items()}
        loaded = {}
        for kind in _KINDS:
            loaded[kind] = {}
            for signature, tensor in state[kind].items():
                signature = tuple(str(k) for k in signature)
                unknown = [k for k in signature if k not in numels]
                if unknown:
                    raise ValueError(f"hook state: {kind} of a bucket names parameters {unknown} it has no size for")
                if tensor.dtype != torch.float32 or tensor.dim() != 1:
                    raise ValueError(f"hook state: {kind} must be 1-D float32 tensors, got {tensor.dtype} "
                                     f"{tuple(tensor.shape)}")
                expected = sum(numels[k] for k in signature)
                if kind != "server_residuals" and tensor.numel() != expected:
                    raise ValueError(f"hook state: {kind} of a bucket of {expected} elements has {tensor.numel()}")
                loaded[kind][signature] = tensor.clone()
        self.__init__()
        for kind in _KINDS:
            setattr(self, kind, loaded[kind])
        self.numels = numels
        self.layout = [tuple(str(k) for k in s) for s in state["layout"]]
        self.flat = {tuple(str(k) for k in s) for s in state.get("flat", ())}  # absent: saved before one level existed
        self._loaded_keys = set(numels) if self else None

    def check_server_sizes(self, rank: int, world: int) -> None:
        """Server residuals depend on rank and world size: refuse ones made under others."""
        for signature, tensor in self.server_residuals.items():
            expected = server_residual_numel(sum(self.numels[k] for k in signature), rank, world)
            if tensor.numel() != expected:
                raise ValueError(f"hook state: a server residual has {tensor.numel()} elements where rank {rank} of "
                                 f"{world} has {expected}: it was saved by another rank or world size")


def _fold(worker: torch.Tensor, server: Optional[torch.Tensor], rank: int, world: int,
          group: Optional[dist.ProcessGroup], compressor: Optional[Compressor], flat: bool) -> None:
    """worker += world x server on the chunks this rank reduces (the server residual is in units
    of the average: sent by this rank alone, it must be world times as large), placed by the
    one-level plan if ``flat``, else by the group's."""
    if server is None or not server.numel():
        return
    at = 0
    for begin, end in server_chunks(worker.numel(), rank, world, group, compressor, flat):
        worker[begin:end].add_(server[at : at + end - begin], alpha=world)
        at += end - begin
