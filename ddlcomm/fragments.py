"""The schedule of ``ddlcomm.diloco``'s outer steps: which parameters sync together (fragments),
at which inner steps, and what is on the wire between a fragment's send and its use."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from .compressed import server_residual_numel, wire_bytes
from .compressors import Compressor
from .wire import ring_all_reduce_bytes

__all__ = ["Fragment", "InFlight", "split"]


@dataclass
class Fragment:
    """A contiguous run of the model's parameters that takes its outer step on its own."""

    index: int
    first: int  # its parameters are the model's trained parameters [first:last]
    last: int
    begin: int  # its elements in the flat vector of all parameters (of this rank's part)
    end: int
    server: slice  # its server residual in the flat one of all fragments
    phase: int  # inner steps (mod sync_every) at which it syncs
    sent_bytes: int  # per outer step
    warmup_bytes: int  # per warm-up average of the gradient
    syncs: int = 0


@dataclass
class InFlight:
    """A fragment's average on the wire: applied at inner step ``due``."""

    fragment: Fragment
    due: int
    delta: torch.Tensor  # the pseudo-gradient, then (after wait()) its average
    snapshot: Optional[torch.Tensor]  # the replica's fragment when sent (overlap only)
    future: Any  # the collective's Future or Work; None once waited
    gradient: bool = False  # a warm-up step's gradient average, not an outer step
    # The first fragment's: the floating-point buffers, flat (their sum, then average), their
    # values when sent (overlap only), and the all-reduce's Work (None once waited).
    buffers: Optional[torch.Tensor] = None
    buffers_snapshot: Optional[torch.Tensor] = None
    buffers_work: Any = None


def split(sizes: list[int], fragments: int, sync_every: int, parts: int, rank: int, n: int,
          compressor: Optional[Compressor], warmup_compressor: Optional[Compressor]) -> list[Fragment]:
    """Contiguous runs of parameters (of ``sizes`` elements) of about equal size, fragment k
    syncing at phase (k + 1) * sync_every / fragments; with ``parts`` > 1 (one fragment) rank
    ``rank`` of ``n`` syncs 1/parts of it, padded to equal parts."""
    total, cuts, running = sum(sizes), [0], 0
    for i, size in enumerate(sizes):
        running += size
        # Cut once the run reaches its share, leaving a parameter for each later fragment.
        left = len(sizes) - i - 1
        if len(cuts) < fragments and running * fragments >= total * len(cuts) and left >= fragments - len(cuts):
            cuts.append(i + 1)
    while len(cuts) < fragments:  # huge last parameters: one fragment each
        cuts.append(cuts[-1] + 1)
    cuts.append(len(sizes))
    out, begin, server = [], 0, 0
    for k in range(fragments):
        count = -(-sum(sizes[cuts[k]:cuts[k + 1]]) // parts)
        sent, warm = (ring_all_reduce_bytes(count * 4, n) if c is None else wire_bytes(c, count, n, rank)
                      for c in (compressor, warmup_compressor))
        residual = server_residual_numel(count, rank, n)
        out.append(Fragment(k, cuts[k], cuts[k + 1], begin, begin + count, slice(server, server + residual),
                            (k + 1) * sync_every // fragments % sync_every, sent, warm))
        begin, server = begin + count, server + residual
    return out
