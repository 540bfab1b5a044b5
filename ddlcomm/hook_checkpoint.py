"""Checkpoints of a compressed DDP hook's state: ``state_dict()``, ``load_state_dict()`` and pickling.

Each rank saves and loads its own state (error-feedback memory differs between ranks), keyed
by parameter names or optimizer positions so that it comes back to the same parameters
whatever DDP's bucket layout. ``CompressionState`` (``ddlcomm.hooks``) mixes this in; the
first iterations after a load are reduced in the saved layout (``_replay_left``).
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch.distributed as dist

from .ddp_memory import FeedbackMemory
from .options import CompressionStats

__all__ = ["HookCheckpoint"]

logger = logging.getLogger("ddlcomm.hooks")

# 2: server residuals follow the piecewise compressed all-reduce (ddlcomm.compressed).
# 3: memory keyed by the bucket's parameters (ddlcomm.ddp_memory), with layout, rank and world size.
_STATE_VERSION = 3
# A new DDP wrapper rebuilds its buckets after its first iteration, its second with static_graph.
_REPLAY_ITERATIONS = 2


class HookCheckpoint:
    """The checkpoint half of ``ddlcomm.hooks.CompressionState``: what a load leaves to check
    (the saving rank, the attributes a pickle dropped) and to replay, over the state's
    ``memory``, ``keys``, ``iter``, ``stats``, ``tuner``, ``model``, ``optimizer`` and
    ``process_group``; a load also empties the iteration's held buckets."""

    def __init__(self) -> None:
        self._saved_world: Optional[tuple[int, int]] = None  # (rank, world size) a loaded state was made under
        self._replay_left = 0  # iterations after a load that are reduced in the saved layout
        self._detached: tuple[str, ...] = ()  # attributes that were set when pickled

    def _key_scheme(self) -> str:
        return self.keys.scheme(self.model, self.optimizer)

    def _check_attached(self) -> None:
        missing = [name for name in self._detached if getattr(self, name) is None]
        if missing:
            # Residuals of update directions applied to gradients, or keys that no longer name
            # parameters, would train worse without saying so.
            what = "ddlcomm.optim optimizer" if missing[0] == "optimizer" else "model"
            raise RuntimeError(f"ddlcomm hook: this CompressionState was pickled with {' and '.join(missing)}= and "
                               f"loaded without; set state.{missing[0]} (to the loaded {what}) before training")
        self._detached = ()

    def _check_world(self) -> None:
        if self._saved_world is None:
            return
        rank, world = self._world()
        saved_rank, saved_world = self._saved_world
        if (rank, world) != (saved_rank, saved_world):
            raise ValueError(f"ddlcomm hook: this state was saved by rank {saved_rank} of {saved_world} and is loaded "
                             f"on rank {rank} of {world}. Error-feedback memory is per rank: each rank must load the "
                             f"state_dict() it saved itself; to change the world size, start a fresh CompressionState")
        self.memory.check_server_sizes(rank, world)
        self._saved_world = None

    def state_dict(self) -> dict[str, Any]:
        """Everything this rank needs to resume exactly: iteration, error-feedback memory keyed
        by parameter, the bucket layout, statistics, the adaptive choices, and the rank and world
        size it belongs to.

        Each rank saves and loads its own: the memory differs between ranks.
        """
        if self.memory and self._key_scheme() == "process":
            raise ValueError("ddlcomm hook: state_dict() needs CompressionState(model=...) or optimizer=: the "
                             "error-feedback memory is saved against parameter names (or optimizer positions), "
                             "so that it comes back to the same parameters whatever DDP's bucket layout")
        rank, world = self._world() if dist.is_initialized() else (None, None)
        return {
            "version": _STATE_VERSION,
            "rank": rank,
            "world_size": world,
            "keys": self._key_scheme(),
            "iter": self.iter,
            "stats": vars(self.stats).copy(),
            **({"adaptive": self.tuner.state_dict()} if self.tuner is not None else {}),
            **self.memory.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores what ``state_dict`` returned on this rank (tensors are copied).

        Raises ValueError for a state saved by another rank or world size (checked here when
        the process group exists, else on first use) or for another model. States from
        versions before 3 (memory keyed by bucket index) keep their iteration and statistics;
        their error-feedback memory restarts from zero (logged). A newer version is refused.
        """
        version = int(state.get("version", 1))
        if version > _STATE_VERSION:
            raise ValueError(f"hook state version {version} is newer than this ddlcomm's ({_STATE_VERSION})")
        self.iter = int(state["iter"])
        self.stats = CompressionStats(**state.get("stats", {}))
        if self.tuner is not None and "adaptive" in state:  # else the choices are measured again
            self.tuner.load_state_dict(state["adaptive"])
        self.memory = FeedbackMemory()
        self._held, self._replay_left = [], 0
        self._saved_world = None
        if version < 3:
            logger.warning("ddlcomm hook: the state is from version %d, whose error-feedback memory was keyed by "
                           "bucket index; it restarts from zero", version)
            return
        if state["keys"] != "process" and self._key_scheme() != state["keys"]:
            want = "model=" if state["keys"] == "names" else "optimizer="
            raise ValueError(f"ddlcomm hook: the state's memory is keyed by {state['keys']}; construct this "
                             f"CompressionState with {want} as well")
        self.memory.load_state_dict(state)
        if state["rank"] is not None:
            self._saved_world = (int(state["rank"]), int(state["world_size"]))
            if dist.is_initialized():
                self._check_world()
        self._replay_left = _REPLAY_ITERATIONS if self.memory.layout else 0

    def __getstate__(self) -> dict[str, Any]:
        # Process groups do not pickle, and the model and optimizer are saved by their owner
        # (the hook refuses to run until they are set again); the rest does (torch.save of a
        # whole state).
        if self.memory and self._key_scheme() == "process":
            self.state_dict()  # raises the reason
        state = {k: v for k, v in self.__dict__.items()
                 if k not in ("process_group", "optimizer", "model", "_inflight")}
        state["_detached"] = tuple(n for n in ("optimizer", "model") if getattr(self, n) is not None) + self._detached
        if dist.is_initialized() and self._saved_world is None:
            state["_saved_world"] = self._world()
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.process_group = self.optimizer = self.model = None
        self._inflight = []
        self._held, self._replay_left = [], _REPLAY_ITERATIONS if self.memory.layout else 0  # as after a load
