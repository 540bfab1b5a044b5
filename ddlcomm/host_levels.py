"""The hosts of a group, for the compressed collectives' two levels: exact inside each host
(over the group's own backend: NVLink with NCCL, shared memory with ddlcomm), compressed only
across hosts (docs/collectives.md, "Compressed all-reduce across hosts").

A group's hosts are found once, at its first compressed all-reduce: every rank publishes its
host identity (``DDLCOMM_HOST_ID``, else the boot id and network namespace, the native
backend's rule) in one all-gather. The rule (two levels where several hosts hold the same
number, 2 or more, of ranks and the group's collectives inside a host are fast: nccl and
ddlcomm groups; ``DDLCOMM_ALLREDUCE_ALGO=hierarchical`` forces them, ``ring`` one
level) and the layout come from the C++ plan
(``compressed_allreduce_host_plan``), so that residuals mean the same on every backend. The
subgroups (the ranks of each host, and the ranks at one place on every host) are made with
``use_local_synchronization``: only their members take part, at the same call on all of them.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch.distributed as dist

from . import _C

__all__ = ["HostLevels", "destroyed", "forget_groups", "host_levels"]

logger = logging.getLogger("ddlcomm.compressed")

_plan = _C.ProcessGroupDdlcomm.compressed_allreduce_host_plan


class HostLevels:
    """A group's two levels.

    Attributes:
        group: the process group (its ranks are the plan's).
        identities: every rank's host identity, by group rank.
        topology: the hosts, e.g. ``"2 hosts x 2 ranks"``.
        host: the subgroup of this rank's host.
        across: the subgroup of the ranks at this rank's place on every host.
    """

    def __init__(self, group: dist.ProcessGroup, identities: list[str], choice: tuple[Optional[str], bool],
                 plan: dict[str, Any]) -> None:
        self.group = group
        self.identities = identities
        self._choice = choice
        self.topology: str = plan["topology"]
        backend = dist.get_backend(group)
        self.host = _subgroup(group, plan["host_ranks"], backend)
        self.across = _subgroup(group, plan["across_ranks"], backend)

    def plan(self, numel: int) -> dict[str, Any]:
        """The two-level plan of a compressed all-reduce of ``numel`` elements (topology,
        host_ranks, across_ranks and server_chunks: ``ProcessGroupDdlcomm.compressed_allreduce_host_plan``)."""
        return _plan(self.identities, dist.get_rank(self.group), numel, *self._choice)


_levels: dict[str, tuple[dist.ProcessGroup, Optional[HostLevels]]] = {}  # by group name
_subgroups: dict[tuple[tuple[int, ...], str], dist.ProcessGroup] = {}  # by global ranks and backend


def host_levels(group: dist.ProcessGroup, algorithm: Optional[str] = None,
                native: bool = False) -> Optional[HostLevels]:
    """The two levels of ``group``, or None where its compressed all-reduces take one.
    ``algorithm``: a ddlcomm group's own ``allreduce_algorithm`` (it wins over
    DDLCOMM_ALLREDUCE_ALGO, as there); ``native``: the group is a ddlcomm group (its collectives
    inside a host go through shared memory). Under ``auto`` only ddlcomm and nccl groups take two
    levels: over gloo the exact collectives inside a host (TCP on loopback) cost more than they
    save (docs/collectives.md). The first call on a group is collective (every rank of it, at the
    same call); later ones are free."""
    cached = _levels.get(group.group_name)
    if cached is not None and cached[0] is group:
        return cached[1]
    identities: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(identities, _C.ProcessGroupDdlcomm.host_identity(), group=group)
    choice = (algorithm, native or dist.get_backend(group) == "nccl")
    plan = _plan(identities, dist.get_rank(group), len(identities), *choice)
    levels = None if plan is None else HostLevels(group, identities, choice, plan)
    _levels[group.group_name] = (group, levels)
    if levels is not None:
        logger.info("ddlcomm: compressed all-reduces over process group %s take two levels, %s: exact inside each "
                    "host over %s, compressed across hosts", group.group_name, levels.topology,
                    dist.get_backend(group))
    return levels


def destroyed(group: dist.ProcessGroup) -> bool:
    """Whether ``group`` was destroyed (``destroy_process_group``, its own or its world's)."""
    try:
        dist.get_process_group_ranks(group)
    except (KeyError, ValueError, RuntimeError):
        return True
    return False


def forget_groups(every: bool = False) -> None:
    """Drops the levels and subgroups kept for destroyed groups, or with ``every`` for all (at
    exit): each entry holds a group, and with it its backend, whose threads must be joined while
    the interpreter is whole (a gloo group's release Python objects as they finish their work)."""
    for key, (group, _) in list(_levels.items()):
        if every or destroyed(group):
            del _levels[key]
    for key, subgroup in list(_subgroups.items()):
        if every or destroyed(subgroup):
            del _subgroups[key]


def _subgroup(group: dist.ProcessGroup, ranks: list[int], backend: str) -> dist.ProcessGroup:
    """The subgroup of ``group``'s ``ranks`` (made by its members only), reused where a group of
    the same global ranks exists (its name is their hash: a second one could not be made)."""
    members = tuple(dist.get_global_rank(group, r) for r in ranks)
    key = (members, backend)
    existing = _subgroups.get(key)
    if existing is not None and not destroyed(existing):  # destroyed with its world?
        return existing
    made = dist.new_group(list(members), backend=backend, use_local_synchronization=True)
    _subgroups[key] = made
    return made
