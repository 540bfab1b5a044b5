"""Bad input and failing peers: every rank must raise a clear torch exception in time."""

from __future__ import annotations

import os
import threading
import time

import torch
import torch.distributed as dist

from common import init, run


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
    expect(ValueError, lambda: dist.recv(t), "source")
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
    """Rank 1 compresses differently, into payloads of the same size: every rank refuses to
    decode what it did not expect instead of summing it."""
    from ddlcomm import compress
    from ddlcomm.compressed import compressed_all_reduce

    rank, n = init(timeout_s=30)
    # 1000 elements on 2 ranks: chunks of 500, two blocks of 256 or of 250 each.
    mine, other = {
        "cast": (compress.FP16(), compress.BF16()),
        "block_size": (compress.OneBit(block_size=256), compress.OneBit(block_size=250)),
    }[kind]
    comp = other if rank == 1 else mine
    assert comp.compressed_nbytes(500) == mine.compressed_nbytes(500)
    # RuntimeError: the future's callback wraps the DistBackendError.
    text = expect(RuntimeError, lambda: compressed_all_reduce(torch.ones(1000), comp).wait(), "same compressor")
    print(f"rank {rank}: {text.splitlines()[0][:300]}")


def peer_exit(when: str) -> None:
    """Rank 1 dies before or during a stream of large all-reduces."""
    timeout = 20.0
    rank, n = init(timeout_s=timeout)
    big = torch.ones(4_000_000)
    dist.all_reduce(big)  # everyone is connected and warm
    if rank == 1:
        if when == "before":
            os._exit(3)
        threading.Timer(0.2, lambda: os._exit(3)).start()
    start = time.monotonic()

    def loop() -> None:
        for _ in range(1000):
            dist.all_reduce(big)

    text = expect(dist.DistBackendError, loop, "rank 1")
    elapsed = time.monotonic() - start
    assert elapsed < timeout + 5, f"took {elapsed:.1f} s, timeout is {timeout}"
    print(f"rank {rank} raised after {elapsed:.2f} s: {text.splitlines()[0][:400]}")


def straggler() -> None:
    """Rank 1 shows up long after the timeout: the others raise once it expires."""
    timeout = 3.0
    rank, n = init(timeout_s=timeout)
    dist.all_reduce(torch.ones(10))
    if rank == 1:
        time.sleep(timeout + 4)
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
    assert "timed out" in text and "rank 1" in text, text
    print(f"rank {rank} raised after {elapsed:.2f} s: {text.splitlines()[0][:400]}")


if __name__ == "__main__":
    run({
        "bad_arguments": bad_arguments,
        "size_mismatch": size_mismatch,
        "small_size_mismatch": small_size_mismatch,
        "dtype_mismatch": dtype_mismatch,
        "op_mismatch": op_mismatch,
        "compressor_mismatch": compressor_mismatch,
        "peer_exit": peer_exit,
        "straggler": straggler,
    })
