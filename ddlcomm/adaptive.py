"""Adaptive compression: the DDP hook sends its buckets the way that finished iterations first
when tried.

The options are sending the buckets exactly, in bfloat16, or through the configured compressor;
on a group whose compressed all-reduces take two levels over hosts (exact inside each host,
compressed across: ``ddlcomm.compressed.two_levels``), also through the compressor in one level
(every rank compresses for the whole group), which is faster where the exact exchange inside a
host costs more than the bytes it keeps off the network (docs/collectives.md). Which is fastest
depends on the link (on loopback or a fast network the encoder costs more than the bytes it
saves; on a slow one the bytes dominate), on the machine's cores and on how much of the
communication hides behind backward, so it is measured rather than modelled, on whole training
steps: each iteration is timed from its first bucket's hook to the next iteration's. A
measurement starts ``SETTLE`` iterations after the warm-up (the first compressed iterations are
slower: allocations) and runs two blocks per option, in one pass from the lossiest (one level
compresses each rank's gradient, two levels the host's sum) to exact and back, so that a
machine slowing down or speeding up over the measurement (a shared machine goes through
slower phases of several iterations) falls on every option alike; a block is one
iteration to switch (an exact send after a lossy one carries the error-feedback memory), then
``TRIALS`` timed ones. The slowest rank's median of each option (one all-reduce, so every rank
takes the same choice) decides: the least lossy option within ``MARGIN`` of the fastest is
chosen (a few percent of time is not worth bits of the gradient, and no measurement here is
more precise). The choice is logged and measured again every ``PERIOD`` iterations (the network
and its load change).

Per bucket, a cost model proposes and whole steps decide. In the timed iterations every CPU
bucket's transfer is timed from the transfers themselves: from when it was issued, or when the
bucket before it arrived if later (buckets go one after another), to when its average is ready,
encoding and decoding included. Fitted per option as ``seconds = alpha + beta * bytes`` over
the buckets (the link's latency and the per-byte cost of link and encoder together), the model
picks per bucket the least lossy option within ``MARGIN`` of its fastest. Where that plan
differs from every single option, it is one more candidate, measured on whole steps like the
others, and ranked last, as if the lossiest: it is kept only where its steps beat every single
option's by more than ``MARGIN``. Per-bucket timings alone (one bucket at a time after
backward, or per iteration in a round robin right after the warm-up) chose options slower in
the step (docs/choosing-a-compressor.md, "Letting the hook choose"), because a bucket's encoder
competes with backward for the cores; and a plan kept within the margin of a single option, as
the least lossy, was slower than it step for step (docs/results/across_hosts.md). CUDA
buckets are not timed (their futures complete before the kernels do): one choice for all of
them.

Switching from one option to another loses nothing: what a lossy option left in the
error-feedback memory is sent by the next (``ddlcomm.hooks`` folds the server residual into
the worker residual, and an exact send, or a send by the other plan, adds it whole:
``ddlcomm.ddp_memory``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import statistics
import time
from typing import Any, Optional

import torch
import torch.distributed as dist

from .compressors import BF16, Compressor

__all__ = ["Option", "Tuner", "fit"]

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
    group takes two levels over hosts, the compressor in one level, in that order of preference;
    and a plan per bucket where the cost model proposes one (module docs).

    Attributes:
        options: the candidates (``Option``), from the least lossy; the one-level option
            until ``bind`` says the group takes one level anyway.
        choice: index into ``options`` once decided, ``PER_BUCKET``, else None.
        buckets: the per-bucket plan (an index into ``options`` per bucket) last proposed by
            the model, what ``PER_BUCKET`` sends; buckets past it send the configured compressor.
        costs: per option, the model's (seconds, seconds per byte) fitted at the last
            measurement; None for an option whose transfers were not timed (CUDA).
        window: the first iteration of the next (or current) measurement.
        measured: the last measurement's seconds per option (the slowest rank's medians), the
            per-bucket plan's last where it was tried.
    """

    SETTLE = 4  # iterations with the current option before a measurement
    TRIALS = 2  # timed iterations of a block (two blocks per option)
    PERIOD = 1000  # iterations between measurements
    MARGIN = 0.10  # the least lossy option this close to the fastest wins
    PER_BUCKET = -1  # choice: each bucket by ``buckets``

    # When the last iteration's first bucket came (a class default: a Tuner pickled without it).
    _started: Optional[float] = None

    def __init__(self, compressor: Compressor, start: int) -> None:
        self.options: list[Option] = [Option(None)]
        for option in (Option(BF16()), Option(compressor), Option(compressor, flat=True)):
            if option not in self.options:
                self.options.append(option)
        self.bound = False
        self.choice: Optional[int] = None
        self.buckets: list[int] = []
        self.costs: list[Optional[tuple[float, float]]] = []
        self.window = start
        self.measured: list[float] = []
        self._mixed = False  # this measurement tries ``buckets`` after the options
        self._reset()

    def _reset(self) -> None:
        self._times: list[list[float]] = [[] for _ in range(len(self.options) + 1)]  # this rank's, per option
        self._service: list[dict[int, list[float]]] = [{} for _ in self.options]  # per option, bucket -> seconds
        self._sizes: dict[int, int] = {}  # bucket -> bytes
        self._sent: dict[int, list[tuple[float, float, int, int]]] = {}  # iteration -> (issued, done, bucket, bytes)

    def bind(self, two_levels: bool) -> None:
        """Before the first compressed iteration: whether the group's compressed all-reduces
        take two levels (``ddlcomm.compressed.two_levels``); where not, one level is the
        compressor's own plan and no option of its own."""
        if self.bound:
            return
        self.bound = True
        if not two_levels:
            chosen = None if self.choice in (None, self.PER_BUCKET) else self.options[self.choice]
            self.options = [o for o in self.options if not o.flat]  # the last: plans index the others
            if chosen is not None:  # a loaded choice of one level: the compressor, which is that here
                self.choice = self.options.index(Option(chosen.compressor))
            self._reset()

    @property
    def length(self) -> int:
        """Iterations of a measurement."""
        return self.SETTLE + len(self._order) * (1 + self.TRIALS)

    @property
    def _order(self) -> list[int]:
        """The options of a measurement's blocks: from the lossiest and back, then the plan."""
        there = list(range(len(self.options) - 1, -1, -1))
        return there + there[::-1] + [self.PER_BUCKET] * (2 if self._mixed else 0)

    def measuring(self, iteration: int) -> bool:
        """Whether ``iteration`` is part of a measurement."""
        return self.window <= iteration < self.window + self.length

    def _trial(self, iteration: int) -> tuple[Optional[int], bool]:
        """(the option ``iteration`` of a measurement sends, None while it settles, PER_BUCKET
        for the plan after the options; whether it is timed)."""
        at = iteration - self.window - self.SETTLE
        if at < 0:
            return None, False
        block, step = divmod(at, 1 + self.TRIALS)
        return self._order[block], step > 0

    def settled(self, iteration: int) -> bool:
        """Whether ``iteration`` runs with the option chosen (benchmarks wait for it)."""
        return self.choice is not None and not self.measuring(iteration)

    def timed(self, iteration: int) -> bool:
        """Whether the hook times ``iteration``'s transfers (``transferred``) for the model."""
        option, timed = self._trial(iteration) if self.measuring(iteration) else (None, False)
        return timed and option != self.PER_BUCKET

    def option(self, iteration: int, bucket: int = 0) -> Option:
        """How ``iteration`` sends ``bucket``: the option on trial, or the chosen one. Without a
        choice outside a measurement (a state loaded without one), the configured compressor in
        the group's plan, and a measurement from the next iteration on (every rank sets the same)."""
        if self.measuring(iteration):
            option = self._trial(iteration)[0]
            if option is None:  # settling: the current choice, before the first the compressor
                option = self._configured if self.choice is None else self.choice
        elif self.choice is None:
            if iteration != self.window + self.length:  # else the measurement's last record is still to come
                self.window = iteration + 1
            option = self._configured
        else:
            option = self.choice
        if option == self.PER_BUCKET:
            option = self.buckets[bucket] if bucket < len(self.buckets) else self._configured
        return self.options[option]

    @property
    def _configured(self) -> int:
        """The configured compressor in the group's own plan: the last option of that plan."""
        return max(i for i, o in enumerate(self.options) if not o.flat)

    def iteration_began(self, iteration: int, group: Optional[dist.ProcessGroup], device: torch.device) -> None:
        """At ``iteration``'s first bucket: the iteration before it took from its own first
        bucket to now (a whole step: forward, backward, communication, optimizer)."""
        now = time.perf_counter()
        if self._started is not None and self.measuring(iteration - 1):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                now = time.perf_counter()
            self.record(iteration - 1, now - self._started, group, device)
        self._started = now

    def transferred(self, iteration: int, bucket: int, nbytes: int, issued: float, done: float) -> None:
        """A timed iteration's bucket: issued at ``issued``, its average ready at ``done``
        (``time.perf_counter``; from the thread that completed it)."""
        self._sent.setdefault(iteration, []).append((issued, done, bucket, nbytes))

    def record(self, iteration: int, seconds: float, group: Optional[dist.ProcessGroup],
               device: torch.device) -> None:
        """``iteration``'s time, after its last bucket; after the options, the model's plan; at
        the end of a measurement, decides (every rank calls this in the same iterations)."""
        if not self.measuring(iteration):
            return
        option, timed = self._trial(iteration)
        if timed:
            self._times[option].append(seconds)
            if option != self.PER_BUCKET:
                self._note_transfers(option, self._sent.pop(iteration, []))
        if iteration + 1 == self.window + self.SETTLE + 2 * len(self.options) * (1 + self.TRIALS) and not self._mixed:
            self._propose(group, device)
            if self._mixed:
                return  # the plan is tried next
        if iteration + 1 != self.window + self.length:
            return
        if self._mixed:
            mixed = torch.tensor([statistics.median(self._times[self.PER_BUCKET])], dtype=torch.float64, device=device)
            dist.all_reduce(mixed, op=dist.ReduceOp.MAX, group=group)
            self.measured.append(float(mixed))
        self._decide()

    def _note_transfers(self, option: int, sent: list[tuple[float, float, int, int]]) -> None:
        """Each bucket's own time: from its issue, or the previous bucket's arrival if later."""
        previous = -math.inf
        for issued, done, bucket, nbytes in sorted(sent):
            self._service[option].setdefault(bucket, []).append(done - max(issued, previous))
            self._sizes[bucket] = nbytes
            previous = max(previous, done)

    def _propose(self, group: Optional[dist.ProcessGroup], device: torch.device) -> None:
        """After the options' blocks: the slowest rank's medians of whole steps and of every
        bucket's transfers (one all-reduce), the model fitted, and its plan; tried next where
        it differs from sending every bucket one way."""
        k, buckets = len(self.options), max(self._sizes, default=-1) + 1
        rows = [[statistics.median(s[b]) if s.get(b) else math.inf for b in range(buckets)] for s in self._service]
        table = torch.tensor([statistics.median(t) for t in self._times[:k]] + sum(rows, []) +
                             [self._sizes.get(b, 0) for b in range(buckets)], dtype=torch.float64, device=device)
        dist.all_reduce(table, op=dist.ReduceOp.MAX, group=group)
        values = table.tolist()
        self.measured = values[:k]
        service = [values[k + o * buckets: k + (o + 1) * buckets] for o in range(k)]
        sizes = values[k + k * buckets:]
        timed = [b for b in range(buckets) if all(math.isfinite(service[o][b]) for o in range(k))]
        self.costs = [fit([sizes[b] for b in timed], [service[o][b] for b in timed]) if timed else None
                      for o in range(k)]
        candidates = [o for o in range(k) if not self.options[o].flat]
        picks = {}
        for b in timed:
            predicted = {o: self.costs[o][0] + self.costs[o][1] * sizes[b] for o in candidates}
            best = min(predicted.values())
            picks[b] = next(o for o in candidates if predicted[o] <= best * (1 + self.MARGIN))
        # Buckets not timed (small ones go exact whatever the option) take the least lossy pick.
        self.buckets = [picks.get(b, min(picks.values(), default=self._configured)) for b in range(buckets)]
        self._mixed = len(set(picks.values())) > 1

    def _decide(self) -> None:
        """The least lossy candidate within MARGIN of the fastest; the plan counts as the
        lossiest: it must beat every option by the margin (module docs)."""
        seconds = dict(zip(range(len(self.options)), self.measured))
        if self._mixed:
            seconds[self.PER_BUCKET] = self.measured[-1]  # last in the dict's order, the order of preference
        best = min(seconds.values())
        self.choice = next(i for i, t in seconds.items() if t <= best * (1 + self.MARGIN))
        models = ", ".join(f"{self.name(o)} {1e3 * c[0]:.2f} ms + {1e9 * c[1]:.2f} ms/MB"
                           for o, c in enumerate(self.costs) if c is not None)
        logger.info("ddlcomm hook: adaptive choice %s (the slowest rank's median of %d iterations: %s%s)",
                    self.name(self.choice), 2 * self.TRIALS,
                    ", ".join(f"{self.name(i)} {1e3 * t:.1f} ms" for i, t in seconds.items()),
                    f"; per bucket, the transfers' model: {models}" if models else "")
        self._mixed = False
        self._reset()
        self.window += self.PERIOD

    def name(self, index: int) -> str:
        if index == self.PER_BUCKET:
            return "per bucket [" + ", ".join(self.name(o) for o in self.buckets) + "]"
        return str(self.options[index])

    def state_dict(self) -> dict[str, Any]:
        per_bucket = self.choice == self.PER_BUCKET
        return {"choice": None if self.choice is None else "per bucket" if per_bucket else self.name(self.choice),
                "window": self.window, **({"buckets": [self.name(o) for o in self.buckets]} if per_bucket else {})}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        names = [self.name(i) for i in range(len(self.options))]
        chosen = state.get("buckets", []) + ([] if state["choice"] in (None, "per bucket") else [state["choice"]])
        unknown = [c for c in chosen if c not in names]
        if unknown:
            raise ValueError(f"hook state: the adaptive choice {unknown[0]} is not among this state's options {names}")
        if state["choice"] == "per bucket":
            self.choice, self.buckets = self.PER_BUCKET, [names.index(c) for c in state["buckets"]]
        else:
            self.choice = None if state["choice"] is None else names.index(state["choice"])
        self.window = int(state["window"])
        self._mixed = False
        self._reset()


def fit(sizes: list[float], seconds: list[float]) -> tuple[float, float]:
    """(alpha, beta) of ``seconds = alpha + beta * size``, least squares, neither negative;
    through the origin where the sizes differ by less than 2x (buckets of one size: noise
    would set alpha, and a bucket's bytes dominate its time)."""
    def per_byte() -> tuple[float, float]:
        return 0.0, sum(x * y for x, y in zip(sizes, seconds)) / sum(x * x for x in sizes)

    if max(sizes) < 2 * min(sizes):
        return per_byte()
    mean_x, mean_y = statistics.fmean(sizes), statistics.fmean(seconds)
    beta = (sum((x - mean_x) * (y - mean_y) for x, y in zip(sizes, seconds)) /
            sum((x - mean_x) ** 2 for x in sizes))
    alpha = mean_y - beta * mean_x
    if alpha < 0:
        return per_byte()
    return (mean_y, 0.0) if beta < 0 else (alpha, beta)
