"""Checkpoints of a compressed DDP hook's state: ``state_dict()``, ``load_state_dict()`` and pickling.

Each rank saves and loads its own state (error-feedback memory differs between ranks), keyed
by parameter names or optimizer positions so that it comes back to the same parameters
whatever DDP's bucket layout. A ``CompressionState`` (``ddlcomm.hooks``) holds a
``HookCheckpoint``, which reads and sets the state's public parts (``memory``, ``keys``,
``iterations``, ``stats``, ``tuner``, ``model``, ``optimizer``, ``process_group``, and
``rank_and_world()``, the rank and world size a state is saved under) and keeps what a load
leaves to check when the hook next runs. The first iterations after a load are
reduced in the saved layout (``Iterations.replay_left``).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Optional

import torch.distributed as dist

from .ddp_memory import FeedbackMemory
from .options import CompressionStats

if TYPE_CHECKING:
    from .hooks import CompressionState

__all__ = ["HookCheckpoint"]

logger = logging.getLogger("ddlcomm.hooks")

# The layout of state_dict(): memory keyed by the bucket's parameters (ddlcomm.ddp_memory), with
# the bucket layout, rank and world size.
_STATE_VERSION = 3
_DETACHABLE = ("optimizer", "model")  # saved by their owners, not in a pickle of the state


class HookCheckpoint:
    """Saves and loads a ``CompressionState``, and checks, when the hook next runs, what a
    load could not check yet.

    Attributes:
        saved_world: the (rank, world size) a loaded or unpickled state was saved under, until
            the hook has checked it against its group's (None: nothing to check).
        detached: the attributes (``"optimizer"``, ``"model"``) that were set when the state was
            pickled and a pickle does not carry: the hook refuses to run until they are set again.
    """

    def __init__(self) -> None:
        self.saved_world: Optional[tuple[int, int]] = None
        self.detached: tuple[str, ...] = ()

    # -- at the first bucket after a load -----------------------------------------------
    def check_loaded(self, state: CompressionState) -> None:
        """Raises where ``state`` cannot train on as loaded: an attribute a pickle dropped is not
        set again, or the state was saved by another rank or world size. Then nothing is left
        to check."""
        missing = [name for name in self.detached if getattr(state, name) is None]
        if missing:
            # Residuals of update directions applied to gradients, or keys that no longer name
            # parameters, would train worse without saying so.
            what = "ddlcomm.optim optimizer" if missing[0] == "optimizer" else "model"
            raise RuntimeError(f"ddlcomm hook: this CompressionState was pickled with {' and '.join(missing)}= and "
                               f"loaded without; set state.{missing[0]} (to the loaded {what}) before training")
        self.detached = ()
        self._check_world(state)

    def _check_world(self, state: CompressionState) -> None:
        if self.saved_world is None:
            return
        rank, world = state.rank_and_world()
        saved_rank, saved_world = self.saved_world
        if (rank, world) != (saved_rank, saved_world):
            raise ValueError(f"ddlcomm hook: this state was saved by rank {saved_rank} of {saved_world} and is loaded "
                             f"on rank {rank} of {world}. Error-feedback memory is per rank: each rank must load the "
                             f"state_dict() it saved itself; to change the world size, start a fresh CompressionState")
        state.memory.check_server_sizes(rank, world)
        self.saved_world = None

    # -- state_dict ---------------------------------------------------------------------
    def state_dict(self, state: CompressionState) -> dict[str, Any]:
        """``CompressionState.state_dict()``."""
        self._check_keys(state)
        rank, world = state.rank_and_world() if dist.is_initialized() else (None, None)
        return {
            "version": _STATE_VERSION,
            "rank": rank,
            "world_size": world,
            "keys": _key_scheme(state),
            "iter": state.iter,
            "stats": vars(state.stats).copy(),
            **({"adaptive": state.tuner.state_dict()} if state.tuner is not None else {}),
            **state.memory.state_dict(),
        }

    def load_state_dict(self, state: CompressionState, saved: dict[str, Any]) -> None:
        """``CompressionState.load_state_dict(saved)``."""
        version = int(saved.get("version", 1))
        if version != _STATE_VERSION:
            raise ValueError(f"hook state version {version} is not this ddlcomm's ({_STATE_VERSION}): "
                             f"{'a newer ddlcomm' if version > _STATE_VERSION else 'a development build before 0.1.0'} "
                             f"wrote it; start from a fresh CompressionState")
        state.iter = int(saved["iter"])
        state.stats = CompressionStats(**saved.get("stats", {}))
        if state.tuner is not None and "adaptive" in saved:  # else the choices are measured again
            state.tuner.load_state_dict(saved["adaptive"])
        state.memory = FeedbackMemory()
        state.iterations.loaded(saved_layout=False)
        self.saved_world = None
        if saved["keys"] != "process" and _key_scheme(state) != saved["keys"]:
            want = "model=" if saved["keys"] == "names" else "optimizer="
            raise ValueError(f"ddlcomm hook: the state's memory is keyed by {saved['keys']}; construct this "
                             f"CompressionState with {want} as well")
        state.memory.load_state_dict(saved)
        if saved["rank"] is not None:
            self.saved_world = (int(saved["rank"]), int(saved["world_size"]))
            if dist.is_initialized():
                self._check_world(state)
        state.iterations.loaded(saved_layout=bool(state.memory.layout))

    # -- pickling -----------------------------------------------------------------------
    def pickled(self, state: CompressionState) -> HookCheckpoint:
        """What a pickle of ``state`` carries of this: the attributes it drops to be set again,
        and the rank and world size to check the state against when it is loaded. Raises where
        the memory's keys would not name the parameters in another process."""
        self._check_keys(state)
        kept = HookCheckpoint()
        kept.detached = tuple(n for n in _DETACHABLE if getattr(state, n) is not None) + self.detached
        kept.saved_world = self.saved_world
        if dist.is_initialized() and kept.saved_world is None:
            kept.saved_world = state.rank_and_world()
        return kept

    def unpickled(self, state: CompressionState) -> None:
        """Completes ``state`` (which holds this) just unpickled: the process group and the
        detached attributes are None until set again, and the next iterations are reduced as
        after a load."""
        state.process_group = None
        for name in _DETACHABLE:
            setattr(state, name, None)
        state.iterations.loaded(saved_layout=bool(state.memory.layout))

    @staticmethod
    def _check_keys(state: CompressionState) -> None:
        if state.memory and _key_scheme(state) == "process":
            raise ValueError("ddlcomm hook: state_dict() needs CompressionState(model=...) or optimizer=: the "
                             "error-feedback memory is saved against parameter names (or optimizer positions), "
                             "so that it comes back to the same parameters whatever DDP's bucket layout")


def _key_scheme(state: CompressionState) -> str:
    return state.keys.scheme(state.model, state.optimizer)
