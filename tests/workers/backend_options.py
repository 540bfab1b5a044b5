"""Scenarios for tests/test_backend_options.py: a group's transport chosen by its pg_options
(ddlcomm.Options), beside and over DDLCOMM_TRANSPORT."""

from __future__ import annotations

import copy
import os
import pickle
from datetime import timedelta

import torch
import torch.distributed as dist

import ddlcomm
from common import assert_equal, check_rank_sum, ddlcomm_stats, init, make_input, reference, run

CPU = torch.device("cpu")
SIZES = (1, 1000, 70_000, 1_000_003)  # up to 4 MB: past the shared-memory windows


def transport_of(group: dist.ProcessGroup) -> str:
    """Which transport carries the group's collectives, from its counters: every other rank
    through shared memory, or none (one host here, so nothing in between)."""
    peers = ddlcomm_stats(group)["shared_memory_peers"]
    if peers == dist.get_world_size(group) - 1:
        return "shm"
    assert peers == 0, f"{peers} shared-memory peers"
    return "tcp"


def check_all_reduce(group: dist.ProcessGroup, gloo: dist.ProcessGroup, salt: int) -> None:
    """all_reduce on `group` gives the reduction computed from every rank's input, and gloo's."""
    rank, n = dist.get_rank(), dist.get_world_size()
    for numel in SIZES:
        for dtype in (torch.float32, torch.int64):
            ours = make_input(rank, numel, dtype, salt=salt)
            theirs = ours.clone()
            dist.all_reduce(ours, group=group)
            dist.all_reduce(theirs, group=gloo)
            expected = reference([make_input(r, numel, dtype, salt=salt) for r in range(n)], "SUM")
            assert_equal(ours, expected, f"all_reduce {dtype} x{numel}")
            assert_equal(ours, theirs, f"all_reduce {dtype} x{numel} against gloo")


def two_transports() -> None:
    """Under DDLCOMM_TRANSPORT (tcp or shm), groups asking for tcp and for shm each get theirs,
    and give the same results as a direct computation and as gloo, also when their operations
    are in flight together; a group without options gets the environment's transport."""
    init("gloo")
    gloo = dist.group.WORLD
    tcp = dist.new_group(backend="ddlcomm", pg_options=ddlcomm.Options(transport="tcp"))
    shm = dist.new_group(backend="ddlcomm", pg_options=ddlcomm.Options(transport="shm"))
    default = dist.new_group(backend="ddlcomm", pg_options=ddlcomm.Options())
    assert transport_of(tcp) == "tcp" and transport_of(shm) == "shm"
    assert transport_of(default) == os.environ["DDLCOMM_TRANSPORT"]
    before = {name: ddlcomm_stats(g) for name, g in (("tcp", tcp), ("shm", shm))}
    check_all_reduce(tcp, gloo, salt=1)
    check_all_reduce(shm, gloo, salt=2)
    after = {name: ddlcomm_stats(g) for name, g in (("tcp", tcp), ("shm", shm))}
    assert after["tcp"]["bytes_sent"] > before["tcp"]["bytes_sent"], (before, after)
    assert after["tcp"]["shared_memory_bytes_sent"] == 0, after
    assert after["shm"]["shared_memory_allreduces"] > before["shm"]["shared_memory_allreduces"], (before, after)
    assert after["shm"]["bytes_sent"] == before["shm"]["bytes_sent"], "collectives on the shm group used TCP"
    # Both groups busy at once: each keeps its own order and results.
    rank, n = dist.get_rank(), dist.get_world_size()
    xs = [torch.full((300_000,), float(rank + i)) for i in range(6)]
    works = [dist.all_reduce(x, group=(tcp, shm)[i % 2], async_op=True) for i, x in enumerate(xs)]
    for i, (x, w) in enumerate(zip(xs, works)):
        w.wait()
        assert_equal(x, torch.full_like(x, n * (n - 1) / 2 + n * i), f"interleaved all_reduce {i}")


def options_round_trip() -> None:
    """A group's options property returns the options it was made with: its transport and spins,
    its timeout (also after set_timeout), name and ranks; they survive deepcopy (what
    split_group does to a parent's) and pickle, and make a group like the first."""
    asked = ddlcomm.Options(transport="shm", spin_us={"shm": 3})
    dist.init_process_group("ddlcomm", pg_options=asked, timeout=timedelta(seconds=45))
    world = dist.group.WORLD
    backend = world._get_backend(CPU)
    got = backend.options
    assert type(got) is ddlcomm.Options, type(got)
    assert (got.transport, got.spin_us, got.backend) == ("shm", {"shm": 3}, "ddlcomm"), got
    assert got._timeout == timedelta(seconds=45), got._timeout
    assert got.group_name == world.group_name, (got.group_name, world.group_name)
    # The caller's object is left as it was.
    assert asked._timeout == timedelta(minutes=30) and asked.group_name == "", (asked._timeout, asked.group_name)
    # The option's shared-memory spin, the environment's TCP one (DDLCOMM_TCP_SPIN_US).
    stats = ddlcomm_stats(world)
    assert transport_of(world) == "shm"
    assert stats["shared_memory_spin_us"] == 3 and stats["spin_us"] == int(os.environ["DDLCOMM_TCP_SPIN_US"]), stats
    backend.set_timeout(timedelta(seconds=50))
    assert backend.options._timeout == timedelta(seconds=50)
    got.transport = "tcp"  # a copy: the group is not changed
    assert backend.options.transport == "shm"

    for clone in (copy.deepcopy(backend.options), copy.copy(backend.options),
                  pickle.loads(pickle.dumps(backend.options))):
        assert type(clone) is ddlcomm.Options, type(clone)
        assert (clone.transport, clone.spin_us, clone._timeout) == ("shm", {"shm": 3}, timedelta(seconds=50)), clone
    child = dist.new_group(backend="ddlcomm", pg_options=copy.deepcopy(backend.options))
    assert transport_of(child) == "shm" and ddlcomm_stats(child)["shared_memory_spin_us"] == 3
    child_options = child._get_backend(CPU).options
    assert child_options.group_name == child.group_name != world.group_name, (child_options.group_name, child)
    assert child_options.global_ranks_in_group == list(range(dist.get_world_size())), child_options
    # The same object for a second group, asking for TCP now.
    asked.transport = "tcp"
    second = dist.new_group(backend="ddlcomm", pg_options=asked)
    assert transport_of(second) == "tcp" and second._get_backend(CPU).options.transport == "tcp"
    for group in (world, child, second):
        check_rank_sum(5000, "all_reduce", group)


def bad_options() -> None:
    """pg_options of another backend raise TypeError, an unknown transport ValueError naming the
    valid ones, both before anything connects; a bad DDLCOMM_TRANSPORT is still refused under
    an option. The ranks go on to make groups afterwards."""
    init()
    assert dist.group.WORLD._get_backend(CPU).options.transport is None  # no pg_options: the environment's
    try:
        dist.new_group(backend="ddlcomm", pg_options=dist.ProcessGroupGloo._Options())
        raise AssertionError("gloo's options accepted")
    except TypeError as e:
        assert "pg_options=ddlcomm.Options" in str(e) and "ProcessGroupGloo" in str(e), e
    try:
        ddlcomm.Options(transport="rdma")
        raise AssertionError("transport='rdma' accepted")
    except ValueError as e:
        assert "'rdma' is invalid: expected auto, tcp, shm or ucx" in str(e), e
    saved = os.environ.get("DDLCOMM_TRANSPORT")
    os.environ["DDLCOMM_TRANSPORT"] = "rdma"
    try:
        dist.new_group(backend="ddlcomm", pg_options=ddlcomm.Options(transport="tcp"))
        raise AssertionError("DDLCOMM_TRANSPORT=rdma accepted")
    except ValueError as e:
        assert "DDLCOMM_TRANSPORT='rdma' is invalid" in str(e), e
    finally:
        os.environ.pop("DDLCOMM_TRANSPORT")
        if saved is not None:
            os.environ["DDLCOMM_TRANSPORT"] = saved
    group = dist.new_group(backend="ddlcomm", pg_options=ddlcomm.Options(transport="tcp"))
    for g in (dist.group.WORLD, group):
        check_rank_sum(1000, "all_reduce after the refusals", g)


if __name__ == "__main__":
    run()
