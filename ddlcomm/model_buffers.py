"""The floating-point buffers of a model's checkpoint (BatchNorm's running statistics), which
``ddlcomm.diloco`` averages exactly over the replicas beside the compressed outer steps.

They travel flat, in one tensor of a common dtype, so that one all-reduce carries them all: one
per buffer, each waited for, would cost a round trip each on a slow network. A non-persistent
buffer (an attention mask) is derived from the others, and left alone."""

from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.distributed as dist

__all__ = ["ModelBuffers"]


class ModelBuffers:
    """The buffers of ``model`` that its ``state_dict`` holds and that are floating point.

    Attributes:
        tensors: the buffers themselves, in the model's order.
        dtype: the dtype they travel in (float32, or wider where a buffer is).
        replica_group: the ranks that train this replica together (they take rank 0's values
            after an average), or None.
    """

    def __init__(self, model: torch.nn.Module, replica_group: Optional[dist.ProcessGroup] = None) -> None:
        saved = {id(t) for t in model.state_dict(keep_vars=True).values()}
        self.tensors = [b for b in model.buffers() if b.is_floating_point() and id(b) in saved]
        self.dtype = functools.reduce(torch.promote_types, (b.dtype for b in self.tensors), torch.float32)
        self.replica_group = replica_group

    def __bool__(self) -> bool:
        return bool(self.tensors)

    def flat(self) -> torch.Tensor:
        """A new flat copy of the buffers, in ``dtype``."""
        return torch.cat([b.reshape(-1).to(self.dtype) for b in self.tensors])

    @torch.no_grad()
    def set(self, average: torch.Tensor, snapshot: Optional[torch.Tensor] = None) -> None:
        """The buffers from their flat ``average``, plus what this replica changed since its
        flat ``snapshot`` where one was taken when the average was sent."""
        if snapshot is not None:
            now = self.flat()
            # Unchanged entries add nothing, infinite ones too (an attention mask's -inf).
            average = average + torch.where(now == snapshot, 0.0, now - snapshot)
        offset = 0
        for b in self.tensors:
            b.copy_(average[offset : offset + b.numel()].view_as(b))
            offset += b.numel()
            if self.replica_group is not None:  # the replica's ranks averaged with others
                dist.broadcast(b, src=dist.get_global_rank(self.replica_group, 0), group=self.replica_group)
