"""Adaptive compression: the DDP hook sends its buckets the way that finished iterations first
when tried.

The options are sending the buckets exactly, in bfloat16, or through the configured
compressor; on a group whose compressed all-reduces take two levels over hosts (exact inside
each host, compressed across: ``ddlcomm.compressed.two_levels``), also through the compressor
in one level (every rank compresses for the whole group), which is faster where the exact
exchange inside a host costs more than the bytes it keeps off the network (docs/collectives.md).
Which is fastest depends on the link (on loopback or a fast network the encoder costs more
than the bytes it saves; on a slow one the bytes dominate), on the machine's cores and on how
much of the communication hides behind backward, so it is measured rather than modelled, on
whole training steps: each iteration is timed from its first bucket's hook to the next
iteration's. A measurement starts ``SETTLE`` iterations after the warm-up (the first
compressed iterations are slower: allocations) and runs one block per option, the lossiest
first (one level compresses each rank's gradient, two levels the host's sum): one iteration
to switch (an exact send after a lossy one carries the error-feedback memory), then
``TRIALS`` timed ones. The slowest rank's median of each option (one all-reduce, so every
rank takes the same choice) decides: the least lossy option within ``MARGIN`` of the fastest
is chosen (a few percent of time is not worth bits of the gradient, and no measurement here
is more precise). The choice is logged and measured again every ``PERIOD`` iterations (the
network and its load change).

One choice for all buckets, from whole steps: options timed per bucket, one bucket at a time
after backward, or per iteration in a round robin that started right after the warm-up,
chose options that were slower in the step (docs/choosing-a-compressor.md, "Letting the
hook choose").

Switching from one option to another loses nothing: what a lossy option left in the
error-feedback memory is sent by the next (``ddlcomm.hooks`` folds the server residual into
the worker residual, and an exact send, or a send by the other plan, adds it whole:
``ddlcomm.ddp_memory``).
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
from typing import Any, Optional

import torch
import torch.distributed as dist

from .compressors import BF16, Compressor

__all__ = ["Option", "Tuner"]

logger = logging.getLogger("ddlcomm.hooks")


@dataclasses.dataclass(frozen=True)
class Option:
    """One way to send the buckets.

    Attributes:
        compressor: None (exactly) or a compressor.
        flat: through the compressor in one level, on a group that takes two over hosts.
    """

    compressor: Optional[Compressor]
    flat: bool = False

    def __str__(self) -> str:
        name = "exact" if self.compressor is None else repr(self.compressor)
        return f"{name} one level" if self.flat else name


class Tuner:
    """Chooses among ``options``: exact, ``BF16()``, the configured compressor and, where the
    group takes two levels over hosts, the compressor in one level, in that order of preference.

    Attributes:
        options: the candidates (``Option``), from the least lossy; the one-level option
            until ``bind`` says the group takes one level anyway.
        choice: index into ``options`` once decided, else None.
        window: the first iteration of the next (or current) measurement.
        measured: the last measurement's seconds per option (the slowest rank's medians).
    """

    SETTLE = 4  # iterations with the current option before a measurement
    TRIALS = 3  # timed iterations of every option per measurement
    PERIOD = 1000  # iterations between measurements
    MARGIN = 0.10  # the least lossy option this close to the fastest wins

    def __init__(self, compressor: Compressor, start: int) -> None:
        self.options: list[Option] = [Option(None)]
        for option in (Option(BF16()), Option(compressor), Option(compressor, flat=True)):
            if option not in self.options:
                self.options.append(option)
        self.bound = False
        self.choice: Optional[int] = None
        self.window = start
        self.measured: list[float] = []
        self._times: list[list[float]] = [[] for _ in self.options]  # this rank's seconds per option

    def bind(self, two_levels: bool) -> None:
        """Before the first compressed iteration: whether the group's compressed all-reduces
        take two levels (``ddlcomm.compressed.two_levels``); where not, one level is the
        compressor's own plan and no option of its own."""
        if self.bound:
            return
        self.bound = True
        if not two_levels:
            chosen = None if self.choice is None else self.options[self.choice]
            self.options = [o for o in self.options if not o.flat]
            if chosen is not None:  # a loaded choice of one level: the compressor, which is that here
                self.choice = self.options.index(Option(chosen.compressor))
            self._times = [[] for _ in self.options]

    @property
    def length(self) -> int:
        """Iterations of a measurement."""
        return self.SETTLE + len(self.options) * (1 + self.TRIALS)

    def measuring(self, iteration: int) -> bool:
        """Whether ``iteration`` is part of a measurement."""
        return self.window <= iteration < self.window + self.length

    def _trial(self, iteration: int) -> tuple[Optional[int], bool]:
        """(the option ``iteration`` of a measurement sends, None while it settles; whether it
        is timed)."""
        at = iteration - self.window - self.SETTLE
        if at < 0:
            return None, False
        block, step = divmod(at, 1 + self.TRIALS)
        return len(self.options) - 1 - block, step > 0

    def settled(self, iteration: int) -> bool:
        """Whether ``iteration`` runs with the option chosen (benchmarks wait for it)."""
        return self.choice is not None and not self.measuring(iteration)

    def option(self, iteration: int) -> Option:
        """The option of ``iteration``'s buckets: the one on trial, or the chosen one. Without a
        choice outside a measurement (a state loaded without one), the configured compressor in
        the group's plan, and a measurement from the next iteration on (every rank sets the same)."""
        if self.measuring(iteration):
            option = self._trial(iteration)[0]
            if option is None:  # settling: the current choice, before the first the compressor
                option = self._configured if self.choice is None else self.choice
            return self.options[option]
        if self.choice is None:
            self.window = iteration + 1
            return self.options[self._configured]
        return self.options[self.choice]

    @property
    def _configured(self) -> int:
        """The configured compressor in the group's own plan: the last option of that plan."""
        return max(i for i, o in enumerate(self.options) if not o.flat)

    def record(self, iteration: int, seconds: float, group: Optional[dist.ProcessGroup],
               device: torch.device) -> None:
        """``iteration``'s time, after its last bucket; at the end of a measurement, decides
        (every rank calls this in the same iterations)."""
        if not self.measuring(iteration):
            return
        option, timed = self._trial(iteration)
        if timed:
            self._times[option].append(seconds)
        if iteration + 1 != self.window + self.length:
            return
        table = torch.tensor([statistics.median(t) for t in self._times], dtype=torch.float64, device=device)
        dist.all_reduce(table, op=dist.ReduceOp.MAX, group=group)
        self.measured = table.tolist()
        best = min(self.measured)
        self.choice = next(i for i, t in enumerate(self.measured) if t <= best * (1 + self.MARGIN))
        logger.info("ddlcomm hook: adaptive choice %s (the slowest rank's median of %d iterations: %s)",
                    self.name(self.choice), self.TRIALS,
                    ", ".join(f"{self.name(i)} {1e3 * t:.1f} ms" for i, t in enumerate(self.measured)))
        self._times = [[] for _ in self.options]
        self.window += self.PERIOD

    def name(self, index: int) -> str:
        return str(self.options[index])

    def state_dict(self) -> dict[str, Any]:
        return {"choice": None if self.choice is None else self.name(self.choice), "window": self.window}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        names = [self.name(i) for i in range(len(self.options))]
        if state["choice"] is not None and state["choice"] not in names:
            raise ValueError(f"hook state: the adaptive choice {state['choice']} is not among this state's "
                             f"options {names}")
        self.choice = None if state["choice"] is None else names.index(state["choice"])
        self.window = int(state["window"])
        self._times = [[] for _ in self.options]
