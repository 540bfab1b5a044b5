"""Scenarios for tests/test_transports.py: which transport carries what, and what the
shared-memory transport leaves behind."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist

from common import assert_equal, check_rank_sum, ddlcomm_stats, init, run


def memfd_links() -> list[str]:
    """This process's open file descriptors that are ddlcomm regions."""
    links = []
    for fd in Path("/proc/self/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if "memfd:ddlcomm" in target:
            links.append(target)
    return links


def mapped_regions() -> int:
    """Distinct ddlcomm regions mapped into this process."""
    inodes = set()
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split()
        if len(fields) >= 6 and "memfd:ddlcomm" in fields[5]:
            inodes.add(fields[4])
    return len(inodes)


def totals(values: list[int]) -> list[int]:
    """Sums over ranks, through gloo (ddlcomm's counters must not move while they are read)."""
    t = torch.tensor(values, dtype=torch.int64)
    dist.all_reduce(t, group=GLOO)
    return t.tolist()


GLOO = None


def shared_memory_used() -> None:
    """Every byte of every collective between ranks of one host goes through shared memory;
    the sockets carry nothing; nothing can open the regions any more."""
    global GLOO
    rank, n = init()
    GLOO = dist.new_group(backend="gloo")
    before = ddlcomm_stats()
    assert before["shared_memory_peers"] == n - 1, before
    check_rank_sum(4 << 20, "all_reduce 16 MiB")
    block = torch.arange(1 << 18, dtype=torch.float32) if rank == 0 else torch.zeros(1 << 18)
    dist.broadcast(block, 0)
    assert_equal(block, torch.arange(1 << 18, dtype=torch.float32), "broadcast 1 MiB")
    after = ddlcomm_stats()
    assert after["shared_memory_allreduces"] == before["shared_memory_allreduces"] + 1, (before, after)
    tcp, shm = totals([after["bytes_sent"] - before["bytes_sent"],
                       after["shared_memory_bytes_sent"] - before["shared_memory_bytes_sent"]])
    # The all-reduce reads the peers' windows; the broadcast's 1 MiB reaches n - 1 ranks through the rings.
    assert tcp == 0, f"{tcp} bytes went over TCP"
    assert (n - 1) << 20 <= shm < (n - 1) * (2 << 20), f"{shm} bytes through the rings"
    assert not memfd_links(), f"region file descriptors still open: {memfd_links()}"
    assert mapped_regions() == n, f"{mapped_regions()} regions mapped, expected this rank's and {n - 1} peers'"
    # Point-to-point messages go through the network transport underneath.
    peer = rank ^ 1
    if peer < n:
        x = torch.full((1000,), float(rank))
        y = torch.empty(1000)
        ops = [dist.P2POp(dist.isend, x, peer), dist.P2POp(dist.irecv, y, peer)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        assert_equal(y, torch.full((1000,), float(peer)), "send/recv")
        assert ddlcomm_stats()["bytes_sent"] - after["bytes_sent"] >= 4000
    windowed_reduce_scatter_and_all_gather(rank, n)


def windowed_reduce_scatter_and_all_gather(rank: int, n: int) -> None:
    """Reduce-scatters and all-gathers between ranks of one host go through the shared windows
    (several fills each, a partial last one), equal to the reduction computed here from every
    rank's input, every rank's output the same bits as the plain reduction's in rank order; in
    place too (the input being this rank's place in the output)."""
    before = ddlcomm_stats()
    # A 1 MiB window takes 2^17 bfloat16 of each of 4 ranks a reduce-scatter fill (3 fills here)
    # and 2^18 float32 an all-gather fill (2).
    m = (1 << 18) + 3
    inputs = [torch.randn(n * m, generator=torch.Generator().manual_seed(10 + r)).to(torch.bfloat16)
              for r in range(n)]
    mine = slice(rank * m, (rank + 1) * m)
    for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.MAX):
        out = torch.empty(m, dtype=torch.bfloat16)
        dist.reduce_scatter_tensor(out, inputs[rank].clone(), op=op)
        expected = inputs[0][mine].float()
        for r in range(1, n):  # rank order, in float32 as ddlcomm's reduction of bfloat16 does
            expected = torch.maximum(expected, inputs[r][mine].float()) if op == dist.ReduceOp.MAX else \
                (expected + inputs[r][mine].float()).bfloat16().float()
        if op == dist.ReduceOp.AVG:
            expected = expected / n
        torch.testing.assert_close(out.float(), expected.bfloat16().float(), rtol=0, atol=0, msg=f"reduce_scatter {op}")
    gathered = torch.empty(n * m)
    gathered[mine] = inputs[rank][mine].float()
    dist.all_gather_into_tensor(gathered, gathered[mine])  # in place
    assert_equal(gathered, torch.cat([inputs[r][r * m:(r + 1) * m].float() for r in range(n)]), "all_gather in place")
    after = ddlcomm_stats()
    assert after["shared_memory_reduce_scatters"] == before["shared_memory_reduce_scatters"] + 3, (before, after)
    assert after["shared_memory_allgathers"] == before["shared_memory_allgathers"] + 1, (before, after)
    tcp, = totals([after["bytes_sent"] - before["bytes_sent"]])
    assert tcp == 0, f"{tcp} bytes went over TCP"


def mixed_hosts() -> None:
    """Ranks 0-1 and 2-3 on two hosts (pid namespaces, or DDLCOMM_HOST_ID): shared memory
    inside each, TCP between them; results as gloo's, the same bits on every rank."""
    global GLOO
    rank, n = init()
    GLOO = dist.new_group(backend="gloo")
    stats = ddlcomm_stats()
    assert stats["shared_memory_peers"] == 1, stats  # only the rank in the same namespace
    for numel in (1, 1000, 70_000, 1_000_003):
        x = torch.randn(numel, generator=torch.Generator().manual_seed(rank * 7 + numel))
        ours, theirs = x.clone(), x.clone()
        dist.all_reduce(ours)
        dist.all_reduce(theirs, group=GLOO)
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
        everyone = [torch.empty_like(ours) for _ in range(n)]
        dist.all_gather(everyone, ours, group=GLOO)
        for other in everyone:
            assert_equal(other, ours, f"all_reduce x{numel}: ranks disagree")
        ints = torch.randint(-50, 50, (numel,), generator=torch.Generator().manual_seed(rank + numel))
        expect = ints.clone()
        dist.all_reduce(expect, group=GLOO)
        dist.all_reduce(ints)
        assert_equal(ints, expect, f"all_reduce int64 x{numel}")
        gathered = torch.empty(numel * n)
        dist.all_gather_into_tensor(gathered, x)
        reference = torch.empty(numel * n)
        dist.all_gather_into_tensor(reference, x, group=GLOO)
        assert_equal(gathered, reference, f"all_gather x{numel}")
    after = ddlcomm_stats()
    tcp, shm = totals([after["bytes_sent"] - stats["bytes_sent"],
                       after["shared_memory_bytes_sent"] - stats["shared_memory_bytes_sent"]])
    assert tcp > 0 and shm > 0, (tcp, shm)


def shm_refused_across_hosts() -> None:
    """DDLCOMM_TRANSPORT=shm with ranks on two "hosts": every rank refuses at init, naming why."""
    try:
        init(timeout_s=30)
    except ValueError as e:
        assert "transport shm (DDLCOMM_TRANSPORT or ddlcomm.Options) needs every rank on this host" in str(e), e
        print(f"rank {os.environ['RANK']}: {str(e)[:300]}")
        return
    raise AssertionError("init succeeded")


def spin_choice() -> None:
    """A waiting rank polls before it sleeps: 50 us in every transport, but with more ranks on
    this host than cores 10 us in the network transports and 5 us in shared memory (yielding).
    The DDLCOMM_*_SPIN_US variables override the choice; stats() reports what was chosen."""
    rank, n = init()
    oversubscribed = n > len(os.sched_getaffinity(0))
    network = "DDLCOMM_UCX_SPIN_US" if os.environ.get("DDLCOMM_TRANSPORT") == "ucx" else "DDLCOMM_TCP_SPIN_US"
    expected_network = int(os.environ.get(network, 10 if oversubscribed else 50))
    expected_shm = int(os.environ.get("DDLCOMM_SHM_SPIN_US", 5 if oversubscribed else 50))
    stats = ddlcomm_stats()
    assert stats["spin_us"] == expected_network, (n, oversubscribed, stats)
    if stats["shared_memory_peers"]:
        assert stats["shared_memory_spin_us"] == expected_shm, (n, oversubscribed, stats)
    check_rank_sum(1024, "all_reduce 4 KiB")


if __name__ == "__main__":
    run()
