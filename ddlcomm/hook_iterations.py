"""The iterations of a compressed DDP hook: how many ran, and what the hook keeps while one runs.

DDP calls the hook once per bucket; the hook knows an iteration has ended at its last bucket.
Until then it may hold the buckets back (to reduce them together: with ``max_grad_norm``, or in
the saved layout right after a load) and it keeps the communication it started, which it
waits for at the end. ``CompressionState`` (``ddlcomm.hooks``) holds one ``Iterations``.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["Iterations", "REPLAY_ITERATIONS"]

# A new DDP wrapper rebuilds its buckets after its first iteration, its second with static_graph.
REPLAY_ITERATIONS = 2


class Iterations:
    """The hook's count of iterations, and its bookkeeping within one.

    Attributes:
        count: iterations run (``CompressionState.iter``).
        held: this iteration's buckets so far, as ``(buffer, parameters, future)``, where the
            hook reduces the whole iteration at its last bucket; else empty.
        inflight: the futures of this iteration's communication, waited for at its end.
        replay_left: iterations still to reduce in the saved bucket layout after a load
            (the one the uninterrupted run used); 0 when none.
    """

    def __init__(self) -> None:
        self.count = 0
        self.held: list[tuple[torch.Tensor, list[torch.Tensor], torch.futures.Future]] = []
        self.inflight: list[torch.futures.Future] = []
        self.replay_left = 0

    def hold(self, buffer: torch.Tensor, params: list[torch.Tensor], future: torch.futures.Future) -> None:
        """Keeps a bucket until the iteration's last one."""
        self.held.append((buffer, params, future))

    def take_held(self) -> list[tuple[torch.Tensor, list[torch.Tensor], torch.futures.Future]]:
        """The buckets held so far; none are held afterwards."""
        held, self.held = self.held, []
        return held

    def replayed(self, same_layout: bool) -> None:
        """One iteration after a load was reduced; ``same_layout``: DDP's buckets were the
        saved ones already, so the replay is over."""
        self.replay_left = 0 if same_layout else self.replay_left - 1

    def loaded(self, saved_layout: bool) -> None:
        """After a load: nothing held, and ``REPLAY_ITERATIONS`` iterations to reduce in the
        saved layout where the state has one (``saved_layout``)."""
        self.held = []
        self.replay_left = REPLAY_ITERATIONS if saved_layout else 0

    def sent(self, future: torch.futures.Future) -> None:
        """A bucket's communication has started."""
        self.inflight.append(future)

    def end(self) -> None:
        """At the iteration's last bucket: counts it, then waits for all its communication (a
        failure raises its own exception here; see ``ddlcomm.hooks``)."""
        self.count += 1
        inflight, self.inflight = self.inflight, []
        for future in inflight:
            future.wait()

    def __getstate__(self) -> dict[str, Any]:
        # Futures do not pickle, and an iteration does not survive its process.
        return {"count": self.count, "replay_left": self.replay_left}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()
        self.count, self.replay_left = state["count"], state["replay_left"]
