"""Bad input and failing peers: every rank must raise a clear torch exception in time."""

from __future__ import annotations

import gc
import os
import re
import signal
import socket
import struct
import threading
import time

import torch
import torch.distributed as dist

from common import init, rss_bytes, run

# A dead or reset peer is detected by its closed connections, not by the timeout: survivors
# raise within 0.02-0.3 s of the failure (docs/failure-modes.md; README, "Errors you can act
# on": well under 2 s). 3 s leaves a 10x margin over the slowest of those on a loaded 2-core CI
# machine, and stays far below the slow path, the group timeout plus a grace period of at
# least 1 s (PEER_FAILURE_TIMEOUT + 1 = 9 s), which a broken fast path would fall back to.
FAST_DETECTION_S = 3.0
# Short, so that a broken fast path fails these tests in seconds rather than in minutes.
PEER_FAILURE_TIMEOUT = 8.0


def expect(exc_type: type, fn, *words: str) -> str:
    try:
        fn()
    except exc_type as e:
        text = str(e)
        missing = [w for w in words if w.lower() not in text.lower()]
        assert not missing, f"{exc_type.__name__} message lacks {missing}: {text}"
        return text
    raise AssertionError(f"expected {exc_type.__name__}, nothing was raised")


def bad_arguments() -> None:
    rank, n = init()
    t = torch.ones(4)
    expect(TypeError, lambda: dist.all_reduce(torch.ones(4, dtype=torch.uint16)), "uint16", "supported")
    expect(TypeError, lambda: dist.all_reduce(torch.ones(4, dtype=torch.int32), op=dist.ReduceOp.AVG), "AVG", "int32")
    expect(TypeError, lambda: dist.all_reduce(t, op=dist.ReduceOp.BAND), "BAND", "float32")
    expect(ValueError, lambda: dist.all_gather([torch.empty(4)], t), "output list")
    expect(ValueError, lambda: dist.all_gather_into_tensor(torch.empty(3), t), "expected")
    expect(TypeError, lambda: dist.all_gather_into_tensor(torch.empty(4 * n, dtype=torch.float64), t), "dtype")
    # Synchronous argument errors leave the group usable.
    dist.all_reduce(t)
    assert torch.all(t == n)


def _mismatch(make) -> None:
    rank, n = init(timeout_s=30)
    start = time.monotonic()
    text = expect(dist.DistBackendError, lambda: dist.all_reduce(make(rank)), "mismatch")
    elapsed = time.monotonic() - start
    assert elapsed < 10, f"mismatch took {elapsed:.1f} s to surface"
    print(f"rank {rank} raised after {elapsed:.2f} s: {text.splitlines()[0][:300]}")
    # The group is unusable afterwards, and says so instead of hanging.
    expect(dist.DistBackendError, lambda: dist.all_reduce(torch.ones(3)), "failed earlier")


def size_mismatch() -> None:
    _mismatch(lambda rank: torch.ones(100_000 if rank != 1 else 100_001))


def small_size_mismatch() -> None:
    _mismatch(lambda rank: torch.ones(10 if rank != 1 else 11))


def dtype_mismatch() -> None:
    _mismatch(lambda rank: torch.ones(1000, dtype=torch.float64 if rank == 1 else torch.float32))


def p2p_size_mismatch() -> None:
    """A point-to-point receive shorter than the message: the receiver raises naming both sizes
    instead of hanging or overrunning its buffer."""
    rank, n = init(timeout_s=30)
    if rank == 1:
        try:
            dist.send(torch.ones(100_000), 0, tag=9)
        except dist.DistBackendError:
            pass  # whether the sender learns of it is the transport's business
    elif rank == 0:
        text = expect(dist.DistBackendError, lambda: dist.recv(torch.empty(10), 1, tag=9), "40 bytes", "400000 bytes")
        print(f"rank 0: {text.splitlines()[0][:300]}")


def op_mismatch() -> None:
    rank, n = init(timeout_s=30)
    t = torch.ones(1000)
    start = time.monotonic()
    if rank == 1:
        text = expect(dist.DistBackendError, lambda: dist.broadcast(t, 0), "mismatch")
    else:
        text = expect(dist.DistBackendError, lambda: dist.all_reduce(t), "mismatch")
    assert time.monotonic() - start < 10
    print(f"rank {rank}: {text.splitlines()[0][:300]}")


def compressor_mismatch(kind: str) -> None:
    """Rank 1 compresses differently, into payloads of the same size: checked first (verify),
    every rank gets a ValueError naming both compressors and the group stays usable; unchecked,
    every rank refuses to decode what it did not expect instead of summing it."""
    from ddlcomm import compressors
    from ddlcomm.compressed import compressed_all_reduce

    rank, n = init(timeout_s=30)
    # 1000 elements on 2 ranks: chunks of 500, two blocks of 256 or of 250 each.
    mine, other = {
        "cast": (compressors.FP16(), compressors.BF16()),
        "block_size": (compressors.OneBit(block_size=256), compressors.OneBit(block_size=250)),
    }[kind]
    comp = other if rank == 1 else mine
    assert comp.compressed_nbytes(500) == mine.compressed_nbytes(500)
    text = expect(ValueError, lambda: compressed_all_reduce(torch.ones(1000), comp).wait(), "ranks disagree")
    print(f"rank {rank}: {text.splitlines()[0][:300]}")
    x = torch.ones(1000)
    dist.all_reduce(x)  # still usable
    assert torch.equal(x, torch.full((1000,), float(n))), x
    # RuntimeError: the future's callback wraps the DistBackendError.
    text = expect(RuntimeError, lambda: compressed_all_reduce(torch.ones(1000), comp, verify=False).wait(),
                  "same compressor")
    print(f"rank {rank}: {text.splitlines()[0][:300]}")


def compressed_mismatch_on_gloo() -> None:
    """On a gloo group (the engine over gloo's send and recv, and the collectives path of CUDA
    tensors over its all-to-all), ranks that reduce different sizes or compressors get a
    ValueError naming both, on every rank; gloo would otherwise abort the process on the
    mismatched payloads."""
    from ddlcomm import compressors
    from ddlcomm.compressed import all_reduce_over_collectives, compressed_all_reduce

    rank, n = init(timeout_s=30)
    gloo = dist.new_group(backend="gloo")
    paths = {"engine": lambda x, comp: compressed_all_reduce(x, comp, group=gloo).wait(),
             "collectives": lambda x, comp: all_reduce_over_collectives(x, comp, None, None, gloo, True, 0, True,
                                                                        False)}
    for name, reduce in paths.items():
        for numel, comp in ((1000 + rank, compressors.OneBit()), (1000, compressors.TopK(ratio=0.1 * (rank + 1)))):
            text = expect(ValueError, lambda: reduce(torch.ones(numel), comp), "ranks disagree", f"rank {rank}")
            print(f"rank {rank} ({name}): {text}")
        x = torch.ones(1000)
        reduce(x, compressors.OneBit())
        assert torch.equal(x, torch.ones(1000)), f"{name}: the group is unusable after a refused call"


def carrier_mismatch() -> None:
    """The engine over a gloo group's send and recv (``engine_of``; gloo's messages carry no
    frame) checks the first message of every call from each peer against what the receiving rank
    expects: an all-to-all whose splits disagree and ranks in different collectives raise
    naming both, instead of reading short or foreign bytes. With DDLCOMM_TRANSPORT=auto the ranks
    (on one host) exchange through shared memory instead, whose frames say as much."""
    import datetime

    from ddlcomm.compressed import engine_of

    rank, n = init(timeout_s=30)
    carrier = os.environ["DDLCOMM_TRANSPORT"] == "tcp"
    # A group a case: the first mismatch breaks the engine of its group.
    splits = engine_of(dist.new_group(backend="gloo"))
    received = torch.empty(30 if rank == 1 else 20)
    mine = torch.arange(20.0)
    # Rank 1 expects 20 elements from rank 0, which sends 10.
    call = lambda: splits.alltoall_base(received, mine, [20, 10] if rank == 1 else [10, 10], [10, 10],
                                        dist.AllToAllOptions()).wait()
    if rank == 1:
        said = ("rank 0 sent 40 bytes", "rank 1 expects 80") if carrier else ("expecting 80 bytes", "with 40 bytes")
        text = expect(dist.DistBackendError, call, "all_to_all", *said)
        print(f"rank 1: {text.splitlines()[0][:300]}")
    else:
        call()  # what rank 1 sent is what rank 0 expected
    # Rank 0 in an all-reduce, rank 1 in a broadcast of the same bytes: rank 1 names both; rank 0
    # waits for rank 1's half of the exchange until the group's timeout or rank 1's exit.
    ops = engine_of(dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=3)))
    if rank == 1:
        root = dist.BroadcastOptions()
        root.rootRank = 0
        said = (("rank 0 is in allreduce", "while rank 1 is in broadcast") if carrier else
                ("rank 1 is in broadcast", "rank 0 sent allreduce"))
        text = expect(dist.DistBackendError, lambda: ops.broadcast([torch.ones(100)], root).wait(), *said)
    else:
        text = expect(dist.DistBackendError, lambda: ops.allreduce([torch.ones(100)], dist.AllreduceOptions()).wait(),
                      "allreduce", "with rank 1" if carrier else "lost rank 1")
    print(f"rank {rank}: {text.splitlines()[0][:300]}")


def hook_peer_killed(backend: str) -> None:
    """A rank dies in the middle of compressed DDP training on a `backend` group: every survivor's
    backward() raises DistBackendError naming it (not torch's RuntimeError wrapper of a future's
    callback)."""
    from torch.nn.parallel import DistributedDataParallel

    from ddlcomm import compressors, hooks

    timeout = PEER_FAILURE_TIMEOUT
    rank, n = init(backend, timeout_s=timeout)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.1)
    ddp.register_comm_hook(hooks.CompressionState(compressor=compressors.OneBit(), start_compress_iter=2,
                                                  min_compression_bytes=0), hooks.compressed_hook)
    last_step_done = [time.monotonic()]

    def train() -> None:
        for step in range(1000):
            if rank == 1 and step == 5:
                _sigkill_self()
            ddp(torch.randn(64, 256)).sum().backward()
            last_step_done[0] = time.monotonic()

    # Timed from the end of the last step every rank completed: rank 1 died after it.
    _expect_peer_failure(timeout, train, since=lambda: last_step_done[0])


def reduce_scatter_peer_killed(backend: str) -> None:
    """A rank dies between ddlcomm.fsdp's compressed reduce-scatters (2M elements each) on a
    `backend` group: every survivor's call raises DistBackendError naming it (on a gloo group
    the exchange runs over gloo's send and recv, which say which peer failed)."""
    from ddlcomm import compressors, fsdp

    timeout = PEER_FAILURE_TIMEOUT
    rank, n = init(backend, timeout_s=timeout)
    state = fsdp.FSDPCompressionState(compressors.OneBit(), start_compress_iter=0, min_compression_bytes=0)
    grad, out = torch.randn(n * 500_000), torch.empty(500_000)
    last_call_done = [time.monotonic()]

    def reduce_scatters() -> None:
        for step in range(1000):
            if rank == 1 and step == 5:
                _sigkill_self()
            state.reduce_scatter("layer", out, grad, dist.group.WORLD, dist.ReduceOp.AVG)
            last_call_done[0] = time.monotonic()

    _expect_peer_failure(timeout, reduce_scatters, since=lambda: last_call_done[0])


def collectives_peer_killed() -> None:
    """A rank dies between compressed all-reduces of the collectives path (CUDA tensors' path,
    here on CPU tensors over a gloo group): every survivor raises gloo's DistBackendError well
    within the group's timeout instead of hanging. gloo names the peer by its address, not its
    rank (ddlcomm's own groups name the rank: peer_killed)."""
    from ddlcomm import compressors
    from ddlcomm.compressed import all_reduce_over_collectives

    timeout = PEER_FAILURE_TIMEOUT * 4
    rank, n = init(timeout_s=timeout)
    gloo = dist.new_group(backend="gloo", timeout=__import__("datetime").timedelta(seconds=timeout))
    grad = torch.randn(1_000_000)
    start = [time.monotonic()]

    def reduces() -> None:
        for step in range(1000):
            if rank == 1 and step == 5:
                _sigkill_self()
            all_reduce_over_collectives(grad, compressors.OneBit(), None, None, gloo, True, step, False, False)
            start[0] = time.monotonic()

    text = expect(dist.DistBackendError, reduces)
    elapsed = time.monotonic() - start[0]
    print(f"rank {rank} raised after {elapsed:.2f} s: {text.splitlines()[0][:300]}", flush=True)
    assert elapsed < timeout / 2, f"took {elapsed:.2f} s against a {timeout} s timeout: {text}"


def _sigkill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _assert_fast_peer_failure(text: str, elapsed: float, timeout: float, culprit: int,
                              bound: float = FAST_DETECTION_S) -> None:
    """The error came from the fast path (a closed or reset connection, or the failure a peer
    published), leads with `culprit`, and came within `bound` seconds; not from the timeout
    path, which names the culprit too ("likely cause: rank 1 was not waiting ...")."""
    headline = text.split("] ", 1)[-1].split(";")[0]  # after the "[ddlcomm rank r/n]" prefix
    assert f"rank {culprit}" in headline, f"the error does not lead with rank {culprit}: {text}"
    assert "timed out" not in text.lower() and "likely cause" not in text, f"the timeout path, not the fast one: {text}"
    assert elapsed < bound, f"took {elapsed:.2f} s (fast detection promises under {bound} s; timeout {timeout} s): {text}"


def _expect_peer_failure(timeout: float, fn, culprit: int = 1, since=None) -> None:
    """Runs `fn` on a survivor: it must raise DistBackendError naming `culprit`, detected fast
    (timed from the call, or from `since()`)."""
    start = time.monotonic()
    text = expect(dist.DistBackendError, fn)
    elapsed = time.monotonic() - (since() if since else start)
    print(f"rank {dist.get_rank()} raised after {elapsed:.2f} s: {text.splitlines()[0][:400]}", flush=True)
    _assert_fast_peer_failure(text, elapsed, timeout, culprit)


def _big_all_reduces() -> None:
    big = torch.ones(4_000_000)
    for _ in range(1000):
        dist.all_reduce(big)


def peer_killed(when: str) -> None:
    """Rank 1 is SIGKILLed before, during or after a large (16 MB) all-reduce."""
    timeout = PEER_FAILURE_TIMEOUT
    rank, n = init(timeout_s=timeout)
    dist.all_reduce(torch.ones(4_000_000))  # everyone is connected and warm
    if when == "after":
        # The failure happens while every rank is idle; the next collective must notice it.
        if rank == 1:
            _sigkill_self()
        time.sleep(0.5)
        _expect_peer_failure(timeout, lambda: dist.all_reduce(torch.ones(10)))
        return
    if rank == 1:
        if when == "before":
            _sigkill_self()
        else:  # during
            threading.Timer(0.2, _sigkill_self).start()
    _expect_peer_failure(timeout, _big_all_reduces)


def _reset_peer_connections() -> None:
    """Aborts every ddlcomm connection of this process with a TCP reset (SO_LINGER 0), as a
    crashed NIC or a middlebox would. dup2 swaps each descriptor for a dead socket in one
    step, so the transport never sees its descriptor number reused."""
    store_port = int(os.environ["MASTER_PORT"])
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            s = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue  # not a socket
        tcp = s.family in (socket.AF_INET, socket.AF_INET6) and s.type == socket.SOCK_STREAM
        try:
            peer_port = s.getpeername()[1] if tcp else None
        except OSError:
            peer_port = None  # unconnected or a listener
        if peer_port is None or peer_port == store_port:
            s.detach()
            continue
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        placeholder = socket.socket()
        os.dup2(placeholder.fileno(), fd)
        placeholder.close()
        s.close()  # the last reference: the kernel sends RST


def connection_reset() -> None:
    """Rank 1's connections are reset in the middle of a stream of large all-reduces. Rank 1
    stays alive and must fail too, instead of hanging."""
    timeout = PEER_FAILURE_TIMEOUT
    rank, n = init(timeout_s=timeout)
    dist.all_reduce(torch.ones(4_000_000))
    if rank == 1:
        threading.Timer(0.2, _reset_peer_connections).start()
        start = time.monotonic()
        text = expect(dist.DistBackendError, _big_all_reduces)
        elapsed = time.monotonic() - start
        print(f"rank 1 (reset) raised after {elapsed:.2f} s: {text.splitlines()[0][:400]}")
        # Its own sockets show nothing, but its peers' published failure must stop it early: it
        # looks once per idle second (docs: 1.2 s), hence a second more than the survivors get.
        _assert_fast_peer_failure(text, elapsed, timeout, culprit=1, bound=FAST_DETECTION_S + 1)
        return
    _expect_peer_failure(timeout, _big_all_reduces)


def straggler() -> None:
    """Rank 1 stops calling collectives: the others raise once the timeout expires."""
    timeout = 2.0
    rank, n = init(timeout_s=timeout)
    dist.all_reduce(torch.ones(10))
    if rank == 1:
        time.sleep(timeout + 3)
        # By now its peers gave up. Its next call may still complete (rank 0's data was
        # already in its socket buffer), but the one after must fail rather than hang.
        def two_more() -> None:
            for _ in range(2):
                dist.all_reduce(torch.ones(10))

        expect(dist.DistBackendError, two_more)
        return
    start = time.monotonic()
    text = expect(dist.DistBackendError, lambda: dist.all_reduce(torch.ones(10)))
    elapsed = time.monotonic() - start
    assert timeout - 0.5 < elapsed < timeout + 3, f"raised after {elapsed:.2f} s with timeout {timeout}"
    # Whoever a rank waited for, every rank names the one that never joined.
    headline = text.split("] ", 1)[-1].split(";")[0]  # after the "[ddlcomm rank r/n]" prefix
    assert "timed out" in text and "likely cause: rank 1 was not waiting" in headline, text
    # What torch's backends say, and what its tests and log watchers look for.
    assert re.search(" (Timed out|closed|timeout) ", text), text
    print(f"rank {rank} raised after {elapsed:.2f} s: {text.splitlines()[0][:400]}")


def straggler_while_others_move_on() -> None:
    """Rank 1 stops calling collectives; rank 2 sends its part of a gather to rank 0 and goes
    on to the next collective 2 s later, where it waits too. Rank 0 times out in the gather
    before rank 2 times out in the all-reduce: it must still name rank 1 alone, since rank 2
    was seen waiting in a later collective (its first probe publishes it), not stuck elsewhere."""
    timeout = 4.0
    rank, n = init(timeout_s=timeout)
    dist.all_reduce(torch.ones(10))
    if rank == 1:
        time.sleep(timeout + 4)
        expect(dist.DistBackendError, lambda: [dist.all_reduce(torch.ones(10)) for _ in range(3)])
        return
    if rank == 2:
        dist.gather(torch.ones(10), dst=0)
        time.sleep(2.0)
        expect(dist.DistBackendError, lambda: dist.all_reduce(torch.ones(10)))
        return
    text = expect(dist.DistBackendError, lambda: dist.gather(torch.ones(10), [torch.empty(10) for _ in range(n)], dst=0))
    headline = text.split("] ", 1)[-1].split(";")[0]
    assert "likely cause: rank 1 was not waiting" in headline, text
    print(f"rank {rank}: {text.splitlines()[0][:400]}")


def _process_usage() -> tuple[int, int, int]:
    """Open descriptors, threads and resident bytes of this process."""
    fds = len(os.listdir("/proc/self/fd"))
    threads = len(os.listdir("/proc/self/task"))
    return fds, threads, rss_bytes()


def init_destroy_cycles(cycles: str) -> None:
    """Connects and tears down the group many times, alternating destroy_process_group and
    abort, with a subgroup and some traffic each time: nothing may accumulate."""
    rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
    warmup, total = 10, int(cycles)
    assert total > warmup, f"run more than {warmup} cycles (the warm-up), not {total}"
    baseline = None
    for cycle in range(total):
        if cycle == warmup:
            gc.collect()
            baseline = _process_usage()
        dist.init_process_group("ddlcomm", store=dist.PrefixStore(f"cycle{cycle}", store), rank=rank, world_size=n)
        t = torch.ones(1 << 18)
        dist.all_reduce(t)
        assert torch.all(t == n)
        sub = dist.new_group([0, 1])
        if rank in (0, 1):
            dist.broadcast(t, 0, group=sub)
        dist.barrier()
        if cycle % 2:
            dist.distributed_c10d._abort_process_group()
        else:
            dist.destroy_process_group()
    gc.collect()
    (fds0, threads0, rss0), (fds1, threads1, rss1) = baseline, _process_usage()
    print(f"rank {rank}: after {warmup} and {total} cycles: fds {fds0} -> {fds1}, threads {threads0} -> {threads1}, "
          f"RSS {rss0 / 2**20:.1f} -> {rss1 / 2**20:.1f} MiB", flush=True)
    assert fds1 == fds0, f"{fds1 - fds0} descriptors leaked over {total - warmup} cycles"
    assert threads1 == threads0, f"{threads1 - threads0} threads leaked over {total - warmup} cycles"
    # One cycle's buffers are about 1 MiB; a leak of them would show as 90 MiB or more.
    assert rss1 - rss0 < 16 * 2**20, f"RSS grew by {(rss1 - rss0) / 2**20:.1f} MiB over {total - warmup} cycles"


if __name__ == "__main__":
    run()
