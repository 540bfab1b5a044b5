"""A compressed DDP hook's per-rank state as one checkpointable object, for trainers whose
checkpoint one process writes (Lightning, Accelerate; docs/lightning.md, docs/accelerate.md).

Error-feedback memory differs between ranks, and with a lossy compressor averaging update
directions so does the optimizer's state (Adam's moments, top-k's momentum: docs/checkpoints.md).
A framework that writes ``state_dict()`` of its objects from rank 0 alone keeps rank 0's only,
and a resumed run would give every rank rank 0's memory and moments. ``RankStates.state_dict()``
gathers every rank's to rank 0 (a collective: the frameworks call it on every rank), and
``load_state_dict`` gives each rank its own back.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from .hooks import CompressionState

__all__ = ["RankStates", "to_cpu"]


class RankStates:
    """Checkpoints ``state`` (a ``CompressionState``) and its optimizer's per-rank state.

    ``state_dict()`` returns ``{"world_size": n, "ranks": [rank 0's, ..., rank n-1's]}`` on the
    group's rank 0 and ``{"world_size": n, "ranks": None}`` elsewhere; each rank's entry holds
    the hook's ``state_dict()`` and, where the hook averages update directions, its optimizer's
    (else None: the optimizer state is then the same on every rank, and the framework saves it).
    Tensors are moved to the CPU. The checkpoint grows by every rank's error-feedback memory
    (about the model's size in float32) and, where it is saved, optimizer state (one model size
    for SGD's momentum, two for Adam's moments).
    """

    def __init__(self, state: CompressionState) -> None:
        if not isinstance(state, CompressionState):
            raise TypeError(f"RankStates takes a ddlcomm.hooks.CompressionState, got {type(state).__name__}")
        self.state = state

    def local_state_dict(self) -> dict[str, Any]:
        """This rank's entry alone, its tensors on the CPU (for a framework where every rank
        writes a file of its own: ``ddlcomm.huggingface``)."""
        state = self.state
        optimizer = state.optimizer.state_dict() if state.optimizer is not None and state.averages_directions else None
        return to_cpu({"hook": state.state_dict(), "optimizer": optimizer})

    def state_dict(self) -> dict[str, Any]:
        """Every rank's state, gathered to the group's rank 0. Call it on every rank."""
        mine = self.local_state_dict()
        group = self.state.process_group
        world = dist.get_world_size(group)
        gathered: Optional[list[Any]] = [None] * world if dist.get_rank(group) == 0 else None
        root = dist.get_global_rank(group, 0) if group is not None else 0
        dist.gather_object(mine, gathered, dst=root, group=group)
        return {"world_size": world, "ranks": gathered}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """This rank's hook state and optimizer state, from what ``state_dict()`` returned on rank 0."""
        self.load_hook_state(state_dict)
        self.load_optimizer_state(state_dict)

    def load_hook_state(self, state_dict: dict[str, Any]) -> None:
        """This rank's hook state alone (before the first iteration after the load)."""
        self.state.load_state_dict(self._mine(state_dict)["hook"])

    def load_optimizer_state(self, state_dict: dict[str, Any]) -> None:
        """This rank's optimizer state, where it was saved; call it after the framework loaded
        rank 0's into the optimizer, which it replaces."""
        self._load_optimizer(self._mine(state_dict).get("optimizer"))

    def load_local_state_dict(self, entry: dict[str, Any]) -> None:
        """What ``local_state_dict()`` returned on this rank: the hook's state, then the
        optimizer's (after the framework loaded its own, which it replaces)."""
        self.state.load_state_dict(entry["hook"])
        self._load_optimizer(entry.get("optimizer"))

    def _load_optimizer(self, saved: Optional[dict[str, Any]]) -> None:
        if saved is None:
            return
        if self.state.optimizer is None:
            raise ValueError("ddlcomm: the checkpoint holds each rank's optimizer state, and this hook's "
                             "CompressionState has no optimizer to load it into: attach it first")
        self.state.optimizer.load_state_dict(saved)

    def _mine(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        group = self.state.process_group
        world = dist.get_world_size(group)
        if not state_dict.get("ranks"):
            raise ValueError("ddlcomm: this compression state holds no rank's entries (it is what RankStates."
                             "state_dict() returned on a rank other than 0, which does not write the checkpoint)")
        if state_dict["world_size"] != world:
            raise ValueError(f"ddlcomm: the checkpoint's compression state is from {state_dict['world_size']} "
                             f"processes and this run has {world}: error-feedback memory is per rank; resume on "
                             f"{state_dict['world_size']}, or start the compression state afresh")
        return state_dict["ranks"][dist.get_rank(group)]


def to_cpu(value: Any) -> Any:
    """``value`` with every tensor in it copied to the CPU (dicts, lists and tuples walked): a
    checkpoint's copy, which training does not change afterwards."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()
    if isinstance(value, dict):
        return {k: to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_cpu(v) for v in value)
    return value
