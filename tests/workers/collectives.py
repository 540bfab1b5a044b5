"""Collective correctness scenarios, run on every rank by tests/test_backend.py."""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

import ddlcomm
from common import ALL_DTYPES, OPS, assert_equal, ddlcomm_stats, init, make_input, op_valid, reference, run

# 16385 float32 crosses the 64 KiB small-message threshold; 300_007 spans several ring segments.
SIZES = [0, 1, 3, 7, 1000, 16385]
LARGE = 300_007
SMALL_MESSAGE_BYTES = 64 * 1024  # DDLCOMM_SMALL_MESSAGE_BYTES's default
# What stats() counts, per all-reduce algorithm.
ALGORITHMS = ("ring", "recursive_doubling", "halving_doubling", "shared_memory", "hierarchical")


def expected_algorithm(numel: int, dtype: torch.dtype, n: int) -> str | None:
    """The all-reduce algorithm ddlcomm must run (csrc/collectives/allreduce.cc), None for none."""
    if n == 1 or numel == 0:
        return None
    forced = os.environ.get("DDLCOMM_ALLREDUCE_ALGO", "auto")
    if forced == "auto" and shared_windows():
        return "shared_memory"
    if forced == "ring":
        return "ring"
    if forced in ("rd", "recursive_doubling"):
        return "recursive_doubling"
    if forced == "halving_doubling":
        return "halving_doubling"
    if forced == "hierarchical":  # on one host: a ring among its ranks, nothing across
        return "hierarchical"
    small = numel * dtype.itemsize <= int(os.environ.get("DDLCOMM_SMALL_MESSAGE_BYTES", SMALL_MESSAGE_BYTES))
    return "recursive_doubling" if small or numel < n else "ring"


def shared_windows() -> bool:
    """Whether all-reduce goes through shared-memory windows: the tests start every rank on
    this host, and DDLCOMM_TRANSPORT auto (the default) or shm uses them there."""
    transport = os.environ.get("DDLCOMM_TRANSPORT", "auto")
    return transport in ("auto", "shm") and os.environ.get("DDLCOMM_SHM_WINDOW_BYTES") != "0"


def algorithm_ran(before: dict, after: dict) -> str | None:
    """Which all-reduce algorithm ran between two ddlcomm_stats() snapshots (one all-reduce)."""
    ran = {a: after[f"{a}_allreduces"] - before[f"{a}_allreduces"] for a in ALGORITHMS}
    assert sum(ran.values()) <= 1 and min(ran.values()) >= 0, ran
    return next((a for a, count in ran.items() if count), None)


def allreduce() -> None:
    rank, n = init()
    reached: dict[torch.dtype, set] = {dtype: set() for dtype in ALL_DTYPES}
    for dtype in ALL_DTYPES:
        # The smallest all-reduce over the small-message threshold: the ring, in auto mode.
        ring_min = SMALL_MESSAGE_BYTES // dtype.itemsize + 1
        for op in OPS:
            if not op_valid(op, dtype):
                continue
            sizes = SIZES + [ring_min] + ([LARGE] if dtype in (torch.float32, torch.bfloat16, torch.int64, torch.bool) else [])
            for numel in sizes:
                inputs = [make_input(r, numel, dtype, op) for r in range(n)]
                t = inputs[rank].clone()
                before = ddlcomm_stats()
                dist.all_reduce(t, op=OPS[op])
                ran = algorithm_ran(before, ddlcomm_stats())
                assert_equal(t, reference(inputs, op), f"all_reduce {op} {dtype} x{numel}")
                expected = expected_algorithm(numel, dtype, n)
                assert ran == expected, f"all_reduce {op} {dtype} x{numel} ran {ran}, expected {expected}"
                reached[dtype].add(ran)
    if "DDLCOMM_ALLREDUCE_ALGO" not in os.environ and "DDLCOMM_SMALL_MESSAGE_BYTES" not in os.environ \
            and not shared_windows():
        # Auto mode over the network: every dtype goes through both algorithms.
        for dtype, algorithms in reached.items():
            assert {"ring", "recursive_doubling"} <= algorithms, f"{dtype} only ran {algorithms}"
    # Real-valued data: every rank must hold the same bits, close to gloo's answer.
    gloo = dist.new_group(backend="gloo")
    for numel in (5000, LARGE):
        x = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
        ours, theirs = x.clone(), x.clone()
        dist.all_reduce(ours)
        dist.all_reduce(theirs, group=gloo)
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
        everyone = [torch.empty_like(ours) for _ in range(n)]
        dist.all_gather(everyone, ours, group=gloo)
        for r, other in enumerate(everyone):
            assert torch.equal(other, ours), f"rank {r} holds different bits than rank {rank}"


def collectives() -> None:
    rank, n = init()
    for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.bool):
        for numel in (0, 1, 1001, 70_000):
            # broadcast from every root (tree for small, chain for large)
            for root in range(n):
                expected = make_input(root, numel, dtype, salt=1)
                t = expected.clone() if rank == root else torch.zeros(numel, dtype=dtype)
                dist.broadcast(t, root)
                assert_equal(t, expected, f"broadcast root {root} {dtype} x{numel}")
            # reduce to every root; non-roots keep their input
            for root in range(n):
                inputs = [make_input(r, numel, dtype, salt=2) for r in range(n)]
                t = inputs[rank].clone()
                dist.reduce(t, root, op=dist.ReduceOp.MAX)
                assert_equal(t, reference(inputs, "MAX") if rank == root else inputs[rank], f"reduce root {root}")
            inputs = [make_input(r, numel, dtype, salt=3) for r in range(n)]
            # all_gather (list) and all_gather_into_tensor
            out = [torch.empty(numel, dtype=dtype) for _ in range(n)]
            dist.all_gather(out, inputs[rank])
            for r in range(n):
                assert_equal(out[r], inputs[r], f"all_gather slot {r}")
            flat = torch.empty(n * numel, dtype=dtype)
            dist.all_gather_into_tensor(flat, inputs[rank])
            assert_equal(flat, torch.cat(inputs), "all_gather_into_tensor")
            # reduce_scatter (list) and reduce_scatter_tensor
            blocks = [[make_input(r * n + b, numel, dtype, salt=4) for b in range(n)] for r in range(n)]
            out = torch.empty(numel, dtype=dtype)
            dist.reduce_scatter(out, [b.clone() for b in blocks[rank]])
            assert_equal(out, reference([blocks[r][rank] for r in range(n)], "SUM"), "reduce_scatter")
            dist.reduce_scatter_tensor(out, torch.cat(blocks[rank]), op=dist.ReduceOp.MIN)
            assert_equal(out, reference([blocks[r][rank] for r in range(n)], "MIN"), "reduce_scatter_tensor")
            # gather / scatter at root n-1
            root = n - 1
            gathered = [torch.empty(numel, dtype=dtype) for _ in range(n)] if rank == root else None
            dist.gather(inputs[rank], gathered, dst=root)
            if rank == root:
                for r in range(n):
                    assert_equal(gathered[r], inputs[r], f"gather slot {r}")
            got = torch.empty(numel, dtype=dtype)
            dist.scatter(got, [blocks[root][b] for b in range(n)] if rank == root else None, src=root)
            assert_equal(got, blocks[root][rank], "scatter")

    # all_to_all_single, equal and uneven splits; all_to_all with lists
    x = torch.arange(n * 6, dtype=torch.float32) + 100 * rank
    y = torch.empty_like(x)
    dist.all_to_all_single(y, x)
    expected = torch.cat([torch.arange(rank * 6, rank * 6 + 6, dtype=torch.float32) + 100 * r for r in range(n)])
    assert_equal(y, expected, "all_to_all_single equal")
    send_splits = [r + 1 for r in range(n)]  # rank sends r+1 rows to rank r
    recv_splits = [rank + 1] * n
    x = torch.full((sum(send_splits), 3), float(rank))
    y = torch.empty(sum(recv_splits), 3)
    dist.all_to_all_single(y, x, output_split_sizes=recv_splits, input_split_sizes=send_splits)
    assert_equal(y, torch.cat([torch.full((rank + 1, 3), float(r)) for r in range(n)]), "all_to_all_single uneven")
    # Ranks that send different totals (rank r sends r + j rows to rank j) are not a mismatch.
    x = torch.cat([torch.full((rank + j, 2), float(100 * rank + j)) for j in range(n)])
    y = torch.empty(sum(j + rank for j in range(n)), 2)
    splits = [rank + j for j in range(n)]
    dist.all_to_all_single(y, x, output_split_sizes=splits, input_split_sizes=splits)
    expected = torch.cat([torch.full((j + rank, 2), float(100 * j + rank)) for j in range(n)])
    assert_equal(y, expected, "all_to_all_single with different totals per rank")
    ins = [torch.full((r + 2,), rank * 10 + r, dtype=torch.int32) for r in range(n)]
    outs = [torch.empty(rank + 2, dtype=torch.int32) for _ in range(n)]
    dist.all_to_all(outs, ins)
    for r in range(n):
        assert_equal(outs[r], torch.full((rank + 2,), r * 10 + rank, dtype=torch.int32), f"all_to_all from {r}")

    # coalesced all-reduce, and non-contiguous tensors (handled through a staged copy)
    tensors = [make_input(rank, k, torch.float32, salt=5).clone() for k in (3, 0, 50)]
    dist.all_reduce_coalesced(tensors)
    for k, t in zip((3, 0, 50), tensors):
        assert_equal(t, reference([make_input(r, k, torch.float32, salt=5) for r in range(n)], "SUM"), "coalesced")
    base = [torch.arange(12, dtype=torch.float32).reshape(3, 4) * (r + 1) for r in range(n)]
    t = base[rank].clone().t()  # 4x3, not contiguous
    assert not t.is_contiguous()
    dist.all_reduce(t)
    assert_equal(t, sum(b.t() for b in base), "non-contiguous all_reduce")
    dist.barrier()

    # point-to-point: a ring of sends, and two tags received in the opposite order
    right, left = (rank + 1) % n, (rank - 1) % n
    got = torch.empty(4)
    reqs = [dist.isend(torch.full((4,), float(rank)), right, tag=7), dist.irecv(got, left, tag=7)]
    for r in reqs:
        r.wait()
    assert_equal(got, torch.full((4,), float(left)), "ring send/recv")
    if rank == 0:
        dist.send(torch.tensor([1.0]), 1, tag=1)
        dist.send(torch.tensor([2.0, 2.0]), 1, tag=2)
    elif rank == 1:
        second, first = torch.empty(2), torch.empty(1)
        dist.recv(second, 0, tag=2)
        dist.recv(first, 0, tag=1)
        assert second.tolist() == [2.0, 2.0] and first.tolist() == [1.0], "tag matching"
    # DDLCOMM_SOCKETS_PER_PEER took effect: the kernel shows that many connections to each peer
    # (counted before the last barrier, which no rank leaves, to close them, before all are here).
    k = int(os.environ.get("DDLCOMM_SOCKETS_PER_PEER", "1"))
    connections = ddlcomm_stats()["connections_per_peer"]
    assert connections == [0 if r == rank else k for r in range(n)], f"connections per peer {connections}, expected {k}"
    dist.barrier()


def async_ops() -> None:
    rank, n = init()
    # Several ops in flight at once complete in issue order, and each future holds the
    # caller's own tensor, reduced. The last rank joins late: every other rank attaches its
    # completion callbacks while all four operations are still waiting for it.
    if rank == n - 1:
        time.sleep(0.5)
    tensors = [torch.full((1000 * (i + 1),), float(rank + i)) for i in range(4)]
    works, pending_when_attached, completed = [], [], []
    for i, t in enumerate(tensors):
        works.append(dist.all_reduce(t, async_op=True))
        works[-1].get_future().add_done_callback(lambda _, i=i: completed.append(i))
        pending_when_attached.append(not works[-1].is_completed())
    if rank != n - 1:
        assert all(pending_when_attached), f"operations completed before their callbacks: {pending_when_attached}"
    futures = [w.get_future() for w in works]
    for i, (w, f) in enumerate(zip(works, futures)):
        w.wait()
        assert w.is_completed() and w.is_success()
        value = f.wait()[0]
        assert value.data_ptr() == tensors[i].data_ptr(), f"future {i} holds a copy, not the caller's tensor"
        assert_equal(value, torch.full((1000 * (i + 1),), float(sum(r + i for r in range(n)))), f"async all_reduce {i}")
    assert completed == [0, 1, 2, 3], f"completed in the order {completed}"
    chained = dist.all_reduce(torch.ones(10), async_op=True).get_future().then(lambda f: f.value()[0] * 2)
    assert torch.all(chained.wait() == 2 * n)


def direct() -> None:
    """ddlcomm.all_reduce_ is dist.all_reduce without c10d's dispatch: the same bits for every
    dtype and op, the same algorithm, in order with operations in flight, the same refusals."""
    rank, n = init()
    for dtype in ALL_DTYPES:
        for op in OPS:
            if not op_valid(op, dtype):
                continue
            for numel in [1, 1000, 16385] + ([LARGE] if dtype == torch.float32 else []):
                inputs = [make_input(r, numel, dtype, op) for r in range(n)]
                ours, theirs = inputs[rank].clone(), inputs[rank].clone()
                before = ddlcomm_stats()
                assert ddlcomm.all_reduce_(ours, OPS[op]) is ours
                ran = algorithm_ran(before, ddlcomm_stats())
                assert ran == expected_algorithm(numel, dtype, n), f"all_reduce_ {op} {dtype} x{numel} ran {ran}"
                dist.all_reduce(theirs, op=OPS[op])
                assert_equal(ours, reference(inputs, op), f"all_reduce_ {op} {dtype} x{numel}")
                assert_equal(ours, theirs, f"all_reduce_ against dist.all_reduce, {op} {dtype} x{numel}")
    # What dist.all_reduce's Python layer does besides: complex views, PREMUL_SUM, strides.
    c = torch.full((5,), complex(rank, 1))
    ddlcomm.all_reduce_(c)
    assert_equal(c, torch.full((5,), complex(sum(range(n)), n)), "complex all_reduce_")
    p = torch.full((3,), float(rank))
    ddlcomm.all_reduce_(p, dist._make_nccl_premul_sum(2.0))
    assert_equal(p, torch.full((3,), 2.0 * sum(range(n))), "PREMUL_SUM all_reduce_")
    strided = torch.arange(20.0).reshape(4, 5).t()
    ddlcomm.all_reduce_(strided, dist.ReduceOp.MAX)
    assert_equal(strided, torch.arange(20.0).reshape(4, 5).t(), "non-contiguous all_reduce_")
    # An operation still in flight runs first on every rank.
    a = torch.full((70_000,), float(rank))
    work = dist.all_reduce(a, async_op=True)
    b = torch.full((10,), float(rank + 1))
    ddlcomm.all_reduce_(b)
    work.wait()
    assert_equal(a, torch.full((70_000,), float(sum(range(n)))), "async all_reduce before all_reduce_")
    assert_equal(b, torch.full((10,), float(sum(range(1, n + 1)))), "all_reduce_ after an async all_reduce")
    # Refusals: a gloo group, an unsupported dtype or op; a rank outside the group keeps its tensor.
    expect_error(ValueError, "backend is ddlcomm", lambda: ddlcomm.all_reduce_(torch.ones(3), group=dist.new_group(backend="gloo")))
    expect_error(TypeError, "torch.uint16", lambda: ddlcomm.all_reduce_(torch.ones(3, dtype=torch.uint16)))
    expect_error(ValueError, "ReduceOp.MAX on complex", lambda: ddlcomm.all_reduce_(c, dist.ReduceOp.MAX))
    expect_error(TypeError, "takes a torch.Tensor", lambda: ddlcomm.all_reduce_([p]))
    first = dist.new_group([0])
    alone = torch.full((4,), float(rank))
    assert ddlcomm.all_reduce_(alone, group=first) is alone
    assert_equal(alone, torch.full((4,), float(rank)), "all_reduce_ in a one-rank group, or outside it")
    dist.barrier()


def expect_error(kind: type, text: str, call) -> None:
    try:
        call()
    except kind as e:
        assert text in str(e), f"{kind.__name__} without {text!r}: {e}"
        return
    raise AssertionError(f"no {kind.__name__} ({text!r})")


def subgroups() -> None:
    rank, n = init()
    evens = dist.new_group([r for r in range(n) if r % 2 == 0])
    odds = dist.new_group([r for r in range(n) if r % 2 == 1])
    mine = evens if rank % 2 == 0 else odds
    members = [r for r in range(n) if r % 2 == rank % 2]
    t = torch.tensor([float(rank)] * 5)
    dist.all_reduce(t, group=mine)
    assert torch.all(t == sum(members)), t
    root = members[-1]
    b = torch.tensor([float(rank)])
    dist.broadcast(b, root, group=mine)
    assert b.item() == root
    # the default group still works after the subgroups were used
    t = torch.ones(3)
    dist.all_reduce(t)
    assert torch.all(t == n)


def single_rank() -> None:
    rank, n = init()
    assert n == 1
    t = torch.arange(10.0)
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    assert_equal(t, torch.arange(10.0), "world size 1 all_reduce")
    out = [torch.empty(10)]
    dist.all_gather(out, t)
    assert_equal(out[0], t, "world size 1 all_gather")
    dist.broadcast(t, 0)
    dist.barrier()


def ddp() -> None:
    """20 DDP steps on ddlcomm give the same parameters as on gloo."""
    rank, n = init()
    gloo = dist.new_group(backend="gloo")

    def train(group) -> list[torch.Tensor]:
        torch.manual_seed(0)  # same initial weights for both runs
        model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 5))
        ddp_model = torch.nn.parallel.DistributedDataParallel(model, process_group=group, bucket_cap_mb=0.01)
        opt = torch.optim.SGD(ddp_model.parameters(), lr=0.1, momentum=0.9)
        g = torch.Generator().manual_seed(100 + rank)
        for _ in range(20):
            x = torch.randn(32, 20, generator=g)
            y = torch.randint(0, 5, (32,), generator=g)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(ddp_model(x), y).backward()
            opt.step()
        return [p.detach().clone() for p in model.parameters()]

    ours = train(None)
    theirs = train(gloo)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # and the replicas agree bitwise with each other
    for p in ours:
        copies = [torch.empty_like(p) for _ in range(n)]
        dist.all_gather(copies, p, group=gloo)
        assert all(torch.equal(c, p) for c in copies)


# Relative tolerance per hook on more than 2 ranks, where ddlcomm and gloo sum in different
# orders: a few roundings of the hook's wire dtype (float32, float16) over 6 steps.
HOOK_RTOL = {"allreduce": 1e-5, "fp16_compress": 1e-3, "powerSGD": 1e-4}


def torch_hooks_vs_gloo() -> None:
    """PyTorch's own DDP comm hooks train the same on a ddlcomm group as on a gloo group (PowerSGD's
    callbacks wait for further all-reduces of the same group, which deadlocks if futures complete
    on the progress thread). On 2
    ranks bitwise: each reduction is a single correctly rounded addition of two values, the same
    in either order, for float32 and for the float16 / bfloat16 the compress hooks send
    (PowerSGD's matrices included). On more ranks the summation orders differ: close.
    bf16_compress_hook is left out: torch refuses it without CUDA and NCCL (or XPU and XCCL)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    rank, n = init(timeout_s=60)
    gloo = dist.new_group(backend="gloo")
    hooks = {
        "allreduce": (lambda group: group, default_hooks.allreduce_hook),
        "fp16_compress": (lambda group: group, default_hooks.fp16_compress_hook),
        "powerSGD": (lambda group: powerSGD_hook.PowerSGDState(group, matrix_approximation_rank=2,
                                                                 start_powerSGD_iter=2, min_compression_rate=1,
                                                                 random_seed=0),
                     powerSGD_hook.powerSGD_hook),
    }

    def train(group, make_state, hook) -> torch.Tensor:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.ReLU(), torch.nn.Linear(48, 4))
        ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=group, bucket_cap_mb=0.004)
        ddp.register_comm_hook(make_state(group), hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        for step in range(6):
            opt.zero_grad()
            g = torch.Generator().manual_seed(step * n + rank)
            x, y = torch.randn(16, 32, generator=g), torch.randint(0, 4, (16,), generator=g)
            torch.nn.functional.cross_entropy(ddp(x), y).backward()
            opt.step()
        return torch.cat([p.detach().flatten() for p in model.parameters()])

    def allreduces() -> int:
        s = ddlcomm_stats()
        return sum(s[f"{a}_allreduces"] for a in ALGORITHMS)

    for name, (make_state, hook) in hooks.items():
        before = allreduces()
        ours = train(dist.group.WORLD, make_state, hook)
        ran_on_ddlcomm = allreduces() - before
        before = allreduces()
        theirs = train(gloo, make_state, hook)
        assert ran_on_ddlcomm > 0 and allreduces() == before, f"{name}: the runs used the wrong groups"
        assert torch.isfinite(ours).all(), f"{name}: non-finite parameters"
        if n == 2:
            if not torch.equal(ours, theirs):
                where = (ours != theirs).nonzero().flatten()
                raise AssertionError(f"{name}: {where.numel()} parameters differ from gloo's, the first at "
                                     f"{where[:4].tolist()}: {ours[where[:4]].tolist()} vs {theirs[where[:4]].tolist()}")
        else:
            torch.testing.assert_close(ours, theirs, rtol=HOOK_RTOL[name], atol=HOOK_RTOL[name] * 1e-2,
                                       msg=lambda m, name=name: f"{name}: {m}")
        print(f"rank {rank} {name}: max |ddlcomm - gloo| = {(ours - theirs).abs().max().item():.3g}", flush=True)


FRAME_HEADER_BYTES = 40  # csrc/transport/frame.h


def wire_bytes_measured() -> None:
    """What a compressed all-reduce puts on the group's sockets (TCP_INFO tcpi_bytes_sent, summed
    over its connections) is ddlcomm.compressed.wire_bytes plus one frame header per message:
    n - 1 messages for the sparse formats (an all-gather), 2 (n - 1) per piece for the others
    (an all-to-all, then an all-gather). Unverified (verify=False), as the hooks call it after a
    bucket's first step. Random-k is left out: it all-reduces a finiteness flag first."""
    from ddlcomm import compressors
    from ddlcomm.compressed import compressed_all_reduce, two_levels, wire_bytes

    rank, n = init(timeout_s=60)
    gloo = dist.new_group(backend="gloo")  # synchronizes without ddlcomm traffic
    assert not two_levels()  # finds the group's hosts (one all-gather, at the first compressed call)
    numel = 100_003
    for name, comp in (("onebit", compressors.OneBit()), ("ternary_b37", compressors.Ternary(block_size=37)),
                       ("topk", compressors.TopK(ratio=0.01)), ("topk_approx", compressors.TopK(k=5000, approximate=True)),
                       ("fp16", compressors.FP16()), ("bf16", compressors.BF16())):
        x = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
        dist.barrier(group=gloo)
        before = ddlcomm_stats()
        compressed_all_reduce(x, comp, verify=False).wait()
        dist.barrier(group=gloo)  # every rank has received everything: it left this rank's sockets
        after = ddlcomm_stats()
        dist.barrier(group=gloo)  # every rank has its numbers before any can fail and close its sockets
        # tcpi_bytes_sent counts a segment the kernel sent again twice: not the call's bytes.
        retransmitted = after["bytes_retransmitted"] - before["bytes_retransmitted"]
        sent = after["bytes_sent"] - before["bytes_sent"] - retransmitted
        messages = (n - 1) * (1 if comp.format in ("top_k", "random_k") else 2)  # one piece here
        expected = wire_bytes(comp, numel, n, rank) + FRAME_HEADER_BYTES * messages
        assert sent == expected, (f"{name}: {sent} bytes left rank {rank}'s sockets ({retransmitted} more sent "
                                  f"again), expected {expected} (wire_bytes {wire_bytes(comp, numel, n, rank)} + "
                                  f"{messages} frame headers)")
        print(f"rank {rank} {name}: {sent} bytes sent, as wire_bytes says", flush=True)


if __name__ == "__main__":
    run()
