"""Scenarios for tests/test_topology.py: the hosts a group's ranks are on, and the hierarchical
all-reduce over them."""

from __future__ import annotations

import torch
import torch.distributed as dist

import ddlcomm
from common import ALL_DTYPES, OPS, assert_equal, ddlcomm_stats, init, make_input, op_valid, reference, run
from ddlcomm.host_levels import host_levels

LARGE = 100_000  # elements: over DDLCOMM_SMALL_MESSAGE_BYTES in every dtype, so auto takes the hierarchy


def gathered(x: torch.Tensor, group) -> list[torch.Tensor]:
    everyone = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, x, group=group)
    return everyone


def reduce_scatters(rank: int, n: int, gloo, cases) -> None:
    """reduce_scatter_tensor of small integers (exact in any order) equal to the direct
    reduction of every rank's chunk, for each (dtype, op, elements per rank, group)."""
    for dtype, op, count, group in cases:
        x = make_input(rank, n * count, dtype, op, salt=1)
        expect = reference([y[rank * count:(rank + 1) * count] for y in gathered(x, gloo)], op)
        out = torch.empty(count, dtype=dtype)
        dist.reduce_scatter_tensor(out, x, op=OPS[op], group=group)
        assert_equal(out, expect, f"reduce_scatter_tensor {op} {dtype} x{count}")


def all_gathers(rank: int, n: int, cases) -> None:
    """all_gather_into_tensor and all_gather: every rank's tensor in rank order, for each
    (dtype, elements per rank, group)."""
    for dtype, count, group in cases:
        inputs = [make_input(r, count, dtype, salt=2) for r in range(n)]
        out = torch.empty(n * count, dtype=dtype)
        dist.all_gather_into_tensor(out, inputs[rank], group=group)
        assert_equal(out, torch.cat(inputs), f"all_gather_into_tensor {dtype} x{count}")
        parts = [torch.empty(count, dtype=dtype) for _ in range(n)]
        dist.all_gather(parts, inputs[rank], group=group)
        assert_equal(torch.cat(parts), torch.cat(inputs), f"all_gather {dtype} x{count}")


def hierarchical() -> None:
    """Ranks 0-1 and 2-3 on two named hosts. Every op and dtype through the hierarchical
    all-reduce equals the direct reduction bit for bit (small integers: exact in any order);
    random floats are within rounding of a float64 reference; every rank holds the same bits.
    A group's ddlcomm.Options(allreduce_algorithm=) forces it (down to 1 element) or the flat ring.
    reduce_scatter_tensor alike (exact inside each host, then across). Then DDP with a
    compressed hook over the same hosts."""
    rank, n = init()
    gloo = dist.new_group(backend="gloo")
    forced = dist.new_group(backend="ddlcomm", pg_options=ddlcomm.Options(allreduce_algorithm="hierarchical"))
    flat = dist.new_group(backend="ddlcomm", pg_options=ddlcomm.Options(allreduce_algorithm="ring"))
    before = ddlcomm_stats()
    assert before["topology"] == "2 hosts x 2 ranks", before
    assert host_levels(gloo) is None, "auto keeps a gloo group's compressed all-reduce in one level"
    calls = 0
    for dtype in ALL_DTYPES:
        for op, reduce_op in OPS.items():
            if not op_valid(op, dtype):
                continue
            for numel, group in ((LARGE, None), (LARGE + 3, flat), (5, forced), (1, forced)):
                x = make_input(rank, numel, dtype, op)
                expect = reference(gathered(x, gloo), op)
                dist.all_reduce(x, op=reduce_op, group=group)
                assert_equal(x, expect, f"all_reduce {op} {dtype} x{numel}")
            calls += 1
    x = torch.randn(1_000_003, generator=torch.Generator().manual_seed(rank), dtype=torch.float32)
    exact = torch.stack(gathered(x, gloo)).double().sum(0)
    dist.all_reduce(x)
    torch.testing.assert_close(x.double(), exact, rtol=0, atol=4 * n * torch.finfo(torch.float32).eps * 8)
    for other in gathered(x, gloo):
        assert_equal(other, x, "hierarchical all_reduce: ranks disagree")
    after = ddlcomm_stats()
    assert after["hierarchical_allreduces"] - before["hierarchical_allreduces"] == calls + 1, (before, after)
    assert after["ring_allreduces"] == before["ring_allreduces"], (before, after)
    forced_stats, flat_stats = ddlcomm_stats(forced), ddlcomm_stats(flat)
    assert forced_stats["hierarchical_allreduces"] == 2 * calls and forced_stats["ring_allreduces"] == 0, forced_stats
    assert flat_stats["ring_allreduces"] == calls and flat_stats["hierarchical_allreduces"] == 0, flat_stats
    cases = [(dtype, op, numel, group) for dtype in ALL_DTYPES for op in OPS if op_valid(op, dtype)
             for numel, group in ((LARGE // n, None), (3, flat))]
    reduce_scatters(rank, n, gloo, cases)
    assert ddlcomm_stats()["hierarchical_reduce_scatters"] == calls, ddlcomm_stats()
    assert ddlcomm_stats(flat)["hierarchical_reduce_scatters"] == 0, ddlcomm_stats(flat)
    before = ddlcomm_stats()["hierarchical_allgathers"]
    all_gathers(rank, n, [(dtype, count, group) for dtype in ALL_DTYPES for count, group in ((LARGE, None), (3, flat))])
    assert ddlcomm_stats()["hierarchical_allgathers"] - before == 2 * len(ALL_DTYPES), ddlcomm_stats()
    assert ddlcomm_stats(flat)["hierarchical_allgathers"] == 0, ddlcomm_stats(flat)
    x = torch.randn(n * 250_001, generator=torch.Generator().manual_seed(rank), dtype=torch.float32)
    out = torch.empty(250_001)
    dist.reduce_scatter_tensor(out, x)
    exact = torch.stack(gathered(x, gloo)).double().sum(0)[rank * 250_001:(rank + 1) * 250_001]
    torch.testing.assert_close(out.double(), exact, rtol=0, atol=4 * n * torch.finfo(torch.float32).eps * 8)
    compressed_ddp(rank, gloo)


def many_hosts(expected_topology: str) -> None:
    """More hosts (8 of 1 rank: the forced hierarchy crosses them by halving-doubling; 4 of 2:
    by a ring). Integer ops equal the direct reduction; random floats are within rounding of a
    float64 reference with every rank holding the same bits; the flat halving-doubling too."""
    rank, n = init()
    gloo = dist.new_group(backend="gloo")
    forced = dist.new_group(backend="ddlcomm", pg_options=ddlcomm.Options(allreduce_algorithm="hierarchical"))
    flat = dist.new_group(backend="ddlcomm", pg_options=ddlcomm.Options(allreduce_algorithm="halving_doubling"))
    assert ddlcomm_stats()["topology"] == expected_topology, ddlcomm_stats()
    for dtype, op in ((torch.int64, "SUM"), (torch.int32, "MAX"), (torch.bfloat16, "MIN"), (torch.float32, "AVG")):
        for numel, group in ((LARGE, forced), (LARGE + 3, flat), (7, forced), (1, forced), (n + 1, flat)):
            x = make_input(rank, numel, dtype, op)
            expect = reference(gathered(x, gloo), op)
            dist.all_reduce(x, op=OPS[op], group=group)
            assert_equal(x, expect, f"all_reduce {op} {dtype} x{numel}")
    for group in (forced, flat):
        x = torch.randn(300_007, generator=torch.Generator().manual_seed(rank), dtype=torch.float32)
        exact = torch.stack(gathered(x, gloo)).double().sum(0)
        dist.all_reduce(x, group=group)
        torch.testing.assert_close(x.double(), exact, rtol=0, atol=4 * n * torch.finfo(torch.float32).eps * 8)
        for other in gathered(x, gloo):
            assert_equal(other, x, "all_reduce: ranks disagree")
    assert ddlcomm_stats(flat)["halving_doubling_allreduces"] == 9, ddlcomm_stats(flat)
    assert ddlcomm_stats(forced)["hierarchical_allreduces"] == 13, ddlcomm_stats(forced)
    reduce_scatters(rank, n, gloo, [(torch.int64, "SUM", 1000, forced), (torch.float32, "AVG", 3, forced),
                                    (torch.int32, "MAX", 1000, None), (torch.int32, "MAX", 1000, flat)])
    assert ddlcomm_stats(forced)["hierarchical_reduce_scatters"] == 2, ddlcomm_stats(forced)
    all_gathers(rank, n, [(torch.int64, 1000, forced), (torch.bfloat16, 1, forced), (torch.int32, 5, flat)])
    assert ddlcomm_stats(forced)["hierarchical_allgathers"] == 4, ddlcomm_stats(forced)
    assert ddlcomm_stats(flat)["hierarchical_allgathers"] == 0, ddlcomm_stats(flat)
    one_rank_hosts = expected_topology.endswith(" 1 rank")
    assert ddlcomm_stats()["hierarchical_reduce_scatters"] == (0 if one_rank_hosts else 1), ddlcomm_stats()
    # auto: over 8 one-rank hosts a buffer up to DDLCOMM_HALVING_DOUBLING_BYTES crosses by
    # halving-doubling, a larger one by the ring; 4 hosts of 2 take the hierarchy.
    before = ddlcomm_stats()
    for numel in (LARGE, 300_000):  # 800 KB and 2.4 MB of int64
        x = make_input(rank, numel, torch.int64, "SUM")
        expect = reference(gathered(x, gloo), "SUM")
        dist.all_reduce(x)
        assert_equal(x, expect, f"all_reduce auto x{numel}")
    ran = {k: ddlcomm_stats()[k] - before[k] for k in ("halving_doubling_allreduces", "ring_allreduces",
                                                       "hierarchical_allreduces")}
    assert ran == ({"halving_doubling_allreduces": 1, "ring_allreduces": 1, "hierarchical_allreduces": 0}
                   if one_rank_hosts else
                   {"halving_doubling_allreduces": 0, "ring_allreduces": 0, "hierarchical_allreduces": 2}), ran


def compressed_ddp(rank: int, gloo) -> None:
    """Ranks 0-1 and 2-3 on two named hosts: DDP with the ternary hook takes the hierarchical
    compressed all-reduce (exact inside a host, compressed across), every rank holds the same
    parameters after every step, a new wrapper with other buckets included (the memory is
    remapped over the hierarchical plan), and the loss falls."""
    from torch.nn.parallel import DistributedDataParallel

    from ddlcomm import compressors, hooks

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                torch.nn.ReLU(), torch.nn.Linear(256, 4))
    state = hooks.CompressionState(None, compressors.Ternary(), start_compress_iter=2, min_compression_bytes=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(64, 32, generator=g)
    y = x[:, :4].sum(1, keepdim=True).repeat(1, 4)
    before = ddlcomm_stats()["hierarchical_compressed_allreduces"]
    losses = []
    for step in range(12):
        if step in (0, 8):  # a new wrapper with other buckets at step 8: the memory is remapped
            ddp = DistributedDataParallel(model, bucket_cap_mb=0.1 if step == 0 else 0.03)
            ddp.register_comm_hook(state, hooks.compressed_hook)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        flat = torch.cat([p.detach().flatten() for p in model.parameters()])
        for other in gathered(flat, gloo):
            assert_equal(other, flat, f"parameters after step {step}")
    took = ddlcomm_stats()["hierarchical_compressed_allreduces"] - before
    assert took >= 10 and state.stats.compressed_buckets == took, (took, state.stats)
    assert losses[-1] < 0.8 * losses[0], losses


def unequal_hosts() -> None:
    """Ranks 0-1 on one host, rank 2 on another: auto keeps the flat ring; forcing the hierarchy
    fails on every rank, naming the topology."""
    rank, n = init()
    stats = ddlcomm_stats()
    assert stats["topology"] == "2 hosts of 2 and 1 ranks", stats
    x = torch.full((LARGE,), float(rank + 1))
    dist.all_reduce(x)
    assert_equal(x, torch.full_like(x, 6.0), "all_reduce")
    assert ddlcomm_stats()["ring_allreduces"] == stats["ring_allreduces"] + 1
    try:
        dist.new_group(backend="ddlcomm", pg_options=ddlcomm.Options(allreduce_algorithm="hierarchical"))
    except ValueError as e:
        assert "needs the same number of ranks on every host; this group has 2 hosts of 2 and 1 ranks" in str(e), e
    else:
        raise AssertionError("a hierarchical group over unequal hosts was accepted")


def network(expected: str) -> None:
    """Every rank connected over the `expected` network transport (auto's choice from every
    rank's record), and an all-reduce over it gives the plain sum."""
    rank, n = init(timeout_s=30)
    assert ddlcomm_stats()["network"] == expected, (rank, ddlcomm_stats())
    x = make_input(rank, LARGE, torch.float32)
    expected_sum = reference([make_input(r, LARGE, torch.float32) for r in range(n)], "SUM")
    dist.all_reduce(x)
    assert_equal(x, expected_sum, "all_reduce")


if __name__ == "__main__":
    run()
