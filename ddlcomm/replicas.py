"""Replicas of several ranks each (``ddlcomm.diloco``'s two levels): DDP inside a replica (a
host's shared memory), and the ranks that hold one index in every replica syncing the outer
step, each its part of the pseudo-gradient."""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

__all__ = ["replica_groups", "check_parts"]


def replica_groups(ranks_per_replica: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """(this rank's replica group, its outer group) for ``DiLoCo(replica_group=...,
    process_group=...)``: replicas of ``ranks_per_replica`` consecutive ranks (torchrun numbers
    a host's ranks consecutively), and the ranks of one index across the replicas. Every rank
    must call it (it makes every group)."""
    world = dist.get_world_size()
    if ranks_per_replica < 1 or world % ranks_per_replica:
        raise ValueError(f"ranks_per_replica must divide the world size {world}, got {ranks_per_replica}")
    replicas = [list(range(r, r + ranks_per_replica)) for r in range(0, world, ranks_per_replica)]
    indices = [list(range(i, world, ranks_per_replica)) for i in range(ranks_per_replica)]
    replica, _ = dist.new_subgroups_by_enumeration(replicas)
    outer, _ = dist.new_subgroups_by_enumeration(indices)
    return replica, outer


def check_parts(part: tuple[int, int], process_group: Optional[dist.ProcessGroup]) -> None:
    """Every rank of ``process_group`` must sync the same ``part`` (this rank's index in its
    replica, the replica's size): raises ValueError on every rank if not."""
    mine = torch.tensor(part, dtype=torch.int64)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(process_group))]
    dist.all_gather(everyone, mine, group=process_group)
    if any(not torch.equal(other, mine) for other in everyone):
        parts = [tuple(int(v) for v in other) for other in everyone]
        raise ValueError(f"DiLoCo: process_group must join the ranks of one index in every replica; its ranks "
                         f"hold (index, replica size) {parts} (rank {dist.get_rank()}: {part})")
