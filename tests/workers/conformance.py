"""torch.distributed API conformance scenarios (the less common entry points), run on every
rank by tests/test_conformance.py; each result is checked against gloo or computed directly."""

from __future__ import annotations

import re
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from common import assert_equal, init, make_input, run

CPU = torch.device("cpu")


def all_gather_coalesced() -> None:
    """all_gather_coalesced(output_tensor_lists [rank][input], input_tensor_list), as on gloo."""
    rank, n = init()
    gloo = dist.new_group(backend="gloo")
    for dt in (torch.float32, torch.int64):  # one dtype per call, as torch requires
        shapes = [(3,), (2, 5), (0,), (4, 1)]
        inputs = [make_input(rank, torch.Size(s).numel(), dt, salt=i).reshape(s) for i, s in enumerate(shapes)]
        ours = [[torch.empty(s, dtype=dt) for s in shapes] for _ in range(n)]
        theirs = [[torch.empty(s, dtype=dt) for s in shapes] for _ in range(n)]
        dist.all_gather_coalesced(ours, inputs)
        dist.all_gather_coalesced(theirs, inputs, group=gloo)
        for r in range(n):
            for i, s in enumerate(shapes):
                expected = make_input(r, torch.Size(s).numel(), dt, salt=i).reshape(s)
                assert_equal(ours[r][i], expected, f"all_gather_coalesced {dt} rank {r} input {i}")
                assert_equal(ours[r][i], theirs[r][i], f"all_gather_coalesced {dt} rank {r} input {i} vs gloo")
    ours = [[torch.empty(2, 5, dtype=torch.int64)] for _ in range(n)]
    work = dist.all_gather_coalesced(ours, [inputs[1]], async_op=True)
    work.wait()
    assert_equal(ours[n - 1][0], make_input(n - 1, 10, torch.int64, salt=1).reshape(2, 5), "async")


def monitored_barrier() -> None:
    """gloo's monitored barrier: rank 0 names the ranks that did not arrive within the timeout.
    dist.monitored_barrier() itself only accepts gloo by name; the ProcessGroup method is backend-neutral."""
    rank, n = init()
    world = dist.group.WORLD
    world.monitored_barrier(timedelta(seconds=30))
    world.monitored_barrier(timedelta(seconds=30), wait_all_ranks=True)
    # The last rank stays away: rank 0 raises naming it, within about the timeout.
    g = dist.new_group(backend="ddlcomm")
    if rank == 0:
        start = time.monotonic()
        try:
            g.monitored_barrier(timedelta(seconds=1))
        except RuntimeError as e:
            assert re.search(rf"Rank {n - 1} failed to pass monitoredBarrier in 1000 ms", str(e)), str(e)
        else:
            raise AssertionError("monitored_barrier passed with a rank missing")
        assert time.monotonic() - start < 5, time.monotonic() - start
    elif rank != n - 1:
        try:  # rank 0 raised instead of releasing: these ranks time out too
            g.monitored_barrier(timedelta(seconds=3))
        except RuntimeError as e:
            assert "did not release" in str(e), str(e)
        else:
            raise AssertionError("monitored_barrier released with a rank missing")
    # wait_all_ranks: every rank from 1 on stays away; rank 0 names them all.
    g = dist.new_group(backend="ddlcomm")
    if rank == 0:
        try:
            g.monitored_barrier(timedelta(seconds=1), wait_all_ranks=True)
        except RuntimeError as e:
            missing = ", ".join(str(r) for r in range(1, n))
            assert re.search(rf"Ranks {missing} failed to pass monitoredBarrier in 1000 ms", str(e)), str(e)
        else:
            raise AssertionError("monitored_barrier passed with ranks missing")
    dist.barrier()


def set_timeout() -> None:
    """Backend.set_timeout: later operations of the group time out after the new timeout."""
    rank, n = init()
    g = dist.new_group(backend="ddlcomm", timeout=timedelta(seconds=60))
    backend = g._get_backend(CPU)
    assert backend.options._timeout == timedelta(seconds=60), backend.options._timeout
    assert backend.options.backend == "ddlcomm"
    g.set_timeout(timedelta(seconds=1))
    assert backend.options._timeout == timedelta(seconds=1), backend.options._timeout
    t = torch.ones(4)
    dist.all_reduce(t, group=g)  # still works with everyone present
    assert_equal(t, torch.full((4,), float(n)), "all_reduce after set_timeout")
    dist.barrier()
    start = time.monotonic()
    if rank == 0:  # alone in this all-reduce until the others come, 5 s later
        try:
            dist.all_reduce(t, group=g)
        except RuntimeError as e:
            elapsed = time.monotonic() - start
            assert 0.7 < elapsed < 4, f"timed out after {elapsed:.1f} s, the timeout is 1 s: {e}"
        else:
            raise AssertionError("all_reduce did not time out")
    else:
        time.sleep(5)
        try:
            dist.all_reduce(t, group=g)
        except RuntimeError:
            pass  # rank 0 gave up on the group
    dist.barrier()


def coalescing() -> None:
    """_coalescing_manager (startCoalescing/endCoalescing) and coalesced batch_isend_irecv."""
    rank, n = init()
    inputs = [make_input(rank, k, torch.float32, salt=k) for k in (3, 0, 100)]
    expected = [sum(make_input(r, k, torch.float32, salt=k) for r in range(n)) for k in (3, 0, 100)]
    for async_ops in (False, True):
        tensors = [t.clone() for t in inputs]
        with dist._coalescing_manager(device=CPU, async_ops=async_ops) as cm:
            for t in tensors:
                dist.all_reduce(t)
        if async_ops:
            assert len(cm.works) == 1, cm.works
            cm.wait()
        for k, (t, e) in enumerate(zip(tensors, expected)):
            assert_equal(t, e, f"coalesced all_reduce {k} async={async_ops}")
    # Point-to-point in one coalesced group: a ring both ways, two tags.
    right, left = (rank + 1) % n, (rank - 1) % n
    got_left, got_right = torch.empty(5), torch.empty(5, dtype=torch.int64)
    ops = [
        dist.P2POp(dist.isend, torch.full((5,), float(rank)), right, tag=1),
        dist.P2POp(dist.irecv, got_left, left, tag=1),
        dist.P2POp(dist.isend, torch.full((5,), 10 * rank, dtype=torch.int64), left, tag=2),
        dist.P2POp(dist.irecv, got_right, right, tag=2),
    ]
    works = dist.batch_isend_irecv(ops)
    assert len(works) == 1, works  # one Work for the coalesced group, as on NCCL
    for w in works:
        w.wait()
    assert_equal(got_left, torch.full((5,), float(left)), "batch_isend_irecv from the left")
    assert_equal(got_right, torch.full((5,), 10 * right, dtype=torch.int64), "batch_isend_irecv from the right")
    # Collectives issued in the manager straight to the backend (all_gather_into_tensor's
    # fast path goes through all_gather_single_coalesced) and one Work for all of them.
    outs = [torch.empty(n * 4), torch.empty(n * 2)]
    with dist._coalescing_manager(device=CPU, async_ops=True) as cm:
        dist.all_gather_into_tensor(outs[0], torch.full((4,), float(rank)))
        dist.all_gather_into_tensor(outs[1], torch.full((2,), float(-rank)))
    cm.wait()
    assert_equal(outs[0], torch.arange(n, dtype=torch.float32).repeat_interleave(4), "coalesced all_gather 0")
    assert_equal(outs[1], -torch.arange(n, dtype=torch.float32).repeat_interleave(2), "coalesced all_gather 1")


def complex_dtypes() -> None:
    """complex64/complex128: SUM and AVG as gloo computes them; MIN/MAX rejected as on gloo."""
    rank, n = init()
    gloo = dist.new_group(backend="gloo")
    for dtype in (torch.complex64, torch.complex128):
        x = torch.randn(1001, dtype=dtype, generator=torch.Generator().manual_seed(rank))
        for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG) if hasattr(dist.ReduceOp, "AVG") else (dist.ReduceOp.SUM,):
            ours, theirs = x.clone(), x.clone()
            dist.all_reduce(ours, op=op)
            if op == dist.ReduceOp.AVG:  # gloo has no AVG: its SUM over n
                dist.all_reduce(theirs, group=gloo)
                theirs /= n
            else:
                dist.all_reduce(theirs, group=gloo)
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
        everyone = [torch.empty_like(x) for _ in range(n)]
        dist.all_gather(everyone, x)
        for r in range(n):
            assert_equal(everyone[r], torch.randn(1001, dtype=dtype, generator=torch.Generator().manual_seed(r)),
                         f"all_gather {dtype} slot {r}")
        b = x.clone()
        dist.broadcast(b, n - 1)
        assert_equal(b, torch.randn(1001, dtype=dtype, generator=torch.Generator().manual_seed(n - 1)), "broadcast")
        for op in (dist.ReduceOp.MIN, dist.ReduceOp.MAX):
            try:
                dist.all_reduce(x.clone(), op=op)
            except ValueError:
                pass
            else:
                raise AssertionError(f"all_reduce {op} accepted a complex tensor")


def premul_sum() -> None:
    """PREMUL_SUM: sum over ranks of factor * x_r, the factor a float or a one-element tensor."""
    rank, n = init()
    xs = [make_input(r, 257, torch.float32) for r in range(n)]
    for factor in (2.5, torch.tensor([0.25]), torch.tensor(-3.0, dtype=torch.float64)):
        f = float(factor)
        t = xs[rank].clone()
        dist.all_reduce(t, op=dist._make_nccl_premul_sum(factor))
        assert_equal(t, sum(f * x for x in xs), f"all_reduce premul {factor}")
        # reduce_scatter_tensor and reduce: the same sums, scattered or at a root.
        out = torch.empty(3)
        blocks = [make_input(r, 3 * n, torch.float64, salt=1).float() for r in range(n)]
        dist.reduce_scatter_tensor(out, blocks[rank].clone(), op=dist._make_nccl_premul_sum(factor))
        assert_equal(out, sum(f * b for b in blocks)[3 * rank:3 * rank + 3], f"reduce_scatter_tensor premul {factor}")
        t = xs[rank].clone()
        dist.reduce(t, n - 1, op=dist._make_nccl_premul_sum(factor))
        assert_equal(t, sum(f * x for x in xs) if rank == n - 1 else xs[rank], f"reduce premul {factor}")
    try:
        dist.all_reduce(torch.ones(3, dtype=torch.int32), op=dist._make_nccl_premul_sum(2.0))
    except TypeError:
        pass
    else:
        raise AssertionError("PREMUL_SUM accepted an integer tensor")


def profiler_spans() -> None:
    """Every collective appears in torch.profiler as "ddlcomm:<op>", with its tensor's shape,
    on the thread that runs it: the progress thread, or the caller's for a synchronous
    operation on an idle group, of any size (DDLCOMM_INLINE_BYTES unset)."""
    rank, n = init()
    x, y = torch.ones(1000), torch.ones(6, dtype=torch.float64)
    big = torch.ones(1 << 20)  # 4 MiB
    out = torch.empty(n * 6, dtype=torch.float64)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        dist.all_reduce(x, async_op=True).wait()
        dist.all_reduce(x)
        dist.all_reduce(big)
        dist.all_gather_into_tensor(out, y)
        dist.broadcast(x, 0)
        dist.barrier()
    events = prof.events()
    spans = {e.name: e for e in events if e.name.startswith("ddlcomm:")}
    for name in ("ddlcomm:all_reduce", "ddlcomm:all_gather_into_tensor", "ddlcomm:broadcast", "ddlcomm:barrier"):
        assert name in spans, f"{name} not in the trace: {sorted({e.name for e in events})}"
    assert spans["ddlcomm:all_gather_into_tensor"].input_shapes == [[n * 6]]
    callers = {e.thread for e in events if e.name == "c10d::allreduce_"}
    asynchronous, synchronous, large = [e for e in events if e.name == "ddlcomm:all_reduce"]
    assert asynchronous.input_shapes == [[1000]] and large.input_shapes == [[1 << 20]], large.input_shapes
    assert callers and asynchronous.thread not in callers, (callers, asynchronous.thread)
    assert synchronous.thread in callers and large.thread in callers, (callers, synchronous.thread, large.thread)
    assert_equal(big, torch.full((1 << 20,), float(n)), "large synchronous all_reduce")
    assert_equal(x, torch.full((1000,), float(n * n)), "profiled all_reduce")
    # Without a profiler nothing is recorded, and nothing breaks.
    dist.all_reduce(x)
    assert_equal(x, torch.full((1000,), float(n ** 3)), "all_reduce after profiling")


def recv_any_source() -> None:
    """dist.recv / dist.irecv without src: whichever rank sends first with the tag; recv returns
    its rank and Work.source_rank names it; each sender's messages arrive in order; as on gloo."""
    rank, n = init()
    gloo = dist.new_group(backend="gloo")
    for group, name in ((None, "ddlcomm"), (gloo, "gloo")):
        # Every other rank sends its rank to rank 0: the receives are posted before or after they arrive.
        for posted_first in (True, False):
            if rank == 0:
                got = {}
                if posted_first:
                    bufs = [torch.empty(3) for _ in range(n - 1)]
                    works = [dist.irecv(b, group=group, tag=5) for b in bufs]
                    dist.barrier(group=gloo)
                    for w, b in zip(works, bufs):
                        w.wait()
                        got[w._source_rank()] = b.clone()
                else:
                    dist.barrier(group=gloo)
                    dist.barrier(group=gloo)  # every message has been sent (on ddlcomm, it has arrived)
                    for _ in range(n - 1):
                        b = torch.empty(3)
                        src = dist.recv(b, group=group, tag=5)
                        got[src] = b
                assert sorted(got) == list(range(1, n)), f"{name}: senders {sorted(got)}"
                for src, b in got.items():
                    assert_equal(b, torch.full((3,), float(src)), f"{name}: message of rank {src}")
            else:
                dist.barrier(group=gloo)
                work = dist.isend(torch.full((3,), float(rank)), 0, group=group, tag=5)
                if not posted_first:  # a gloo send completes once received: isend
                    dist.barrier(group=gloo)
                work.wait()
        # One sender's messages with one tag arrive in order; a receive naming the sender and
        # another tag do not disturb it (ddlcomm only: there gloo's receive of tag 10 waits).
        if name != "ddlcomm":
            continue
        if rank == 1:  # isend: a gloo send waits for its receive
            works = [dist.isend(torch.full((2,), float(k)), 0, group=group, tag=9) for k in range(4)]
            works.append(dist.isend(torch.ones(1, dtype=torch.int64), 0, group=group, tag=10))
            for w in works:
                w.wait()
        elif rank == 0:
            one = torch.empty(1, dtype=torch.int64)
            assert dist.recv(one, 1, group=group, tag=10) == 1 and one.item() == 1
            for k in range(4):
                b = torch.empty(2)
                assert dist.recv(b, group=group, tag=9) == 1, name
                assert_equal(b, torch.full((2,), float(k)), f"{name}: message {k} in order")
        dist.barrier(group=gloo)


def sparse_allreduce() -> None:
    """all_reduce of sparse COO tensors (different nnz per rank, rank 0 none, repeated
    indices, dense trailing dims): the same tensor as gloo's, on every rank."""
    rank, n = init()
    gloo = dist.new_group(backend="gloo")
    g = torch.Generator().manual_seed(rank)
    nnz = 0 if rank == 0 else 3 + 4 * rank
    indices = torch.randint(0, 7, (2, nnz), generator=g)  # uncoalesced: indices may repeat
    values = torch.randn(nnz, 3, generator=g)
    x = torch.sparse_coo_tensor(indices, values, (7, 9, 3))
    ours, theirs = x.clone(), x.clone()
    dist.all_reduce(ours)
    dist.all_reduce(theirs, group=gloo)
    assert ours.is_sparse and ours.is_coalesced()
    assert torch.equal(ours._indices(), theirs._indices()), "indices differ from gloo's"
    assert torch.equal(ours._values(), theirs._values()), "values differ from gloo's"
    total = torch.zeros(7, 9, 3)
    for r in range(n):
        gr = torch.Generator().manual_seed(r)
        k = 0 if r == 0 else 3 + 4 * r
        total += torch.sparse_coo_tensor(torch.randint(0, 7, (2, k), generator=gr), torch.randn(k, 3, generator=gr),
                                         (7, 9, 3)).to_dense()
    torch.testing.assert_close(ours.to_dense(), total)
    try:
        dist.all_reduce(x.clone(), op=dist.ReduceOp.MAX)
    except ValueError:
        pass
    else:
        raise AssertionError("a sparse all_reduce with MAX was accepted")


def waits_in_any_order() -> None:
    """Asynchronous operations waited for in any order, with a receive pending or not (the
    waiting thread may run the next queued one itself): every result as computed directly."""
    rank, n = init()
    for pending in (False, True):
        inbox = torch.zeros(3)
        if pending:  # from the previous rank, sent only after the collectives below
            receive = dist.irecv(inbox, src=(rank - 1) % n, tag=3)
        a, b, c = torch.full((5,), rank + 1.0), torch.full((9,), 2.0 * (rank + 1)), torch.full((4,), float(rank))
        wa = dist.all_reduce(a, async_op=True)
        wb = dist.all_reduce(b, async_op=True)
        wc = dist.broadcast(c, src=n - 1, async_op=True)
        wc.wait()
        wb.wait()
        wa.wait()
        total = n * (n + 1) / 2
        assert_equal(a, torch.full((5,), total), f"first all_reduce (receive pending: {pending})")
        assert_equal(b, torch.full((9,), 2 * total), f"second all_reduce (receive pending: {pending})")
        assert_equal(c, torch.full((4,), float(n - 1)), f"broadcast (receive pending: {pending})")
        if pending:
            dist.send(torch.full((3,), float(rank)), dst=(rank + 1) % n, tag=3)
            receive.wait()
            assert_equal(inbox, torch.full((3,), float((rank - 1) % n)), "pending receive")


if __name__ == "__main__":
    run()
