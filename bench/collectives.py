"""Collective microbenchmark: gloo and ddlcomm over each of its transports, in the same run.

Run under torchrun, e.g.::

    torchrun --standalone --nproc-per-node 4 -m bench.collectives --ops all_reduce

Every transport gets its own ddlcomm group (pg_options=ddlcomm.Options(transport=...)),
so gloo, tcp, shm and ucx (in a build with UCX; its own transports as UCX_TLS
says) are measured side by side. With shm, "shm-direct" is its all-reduce called through
ddlcomm.all_reduce_, which skips c10d's dispatch as DeepSpeed's call does. With --deepspeed,
DeepSpeed's shared-memory all-reduce is measured too (DS_ACCELERATOR=cpu
LOCAL_SIZE=<ranks>; "x" in the shm/deepspeed and direct/deepspeed columns is how many times
faster ddlcomm is). Rank 0 prints, for each collective and size, the time
and bus bandwidth of each: bus bandwidth normalizes by how much each rank must move
(all-reduce 2(n-1)/n, all-gather and reduce-scatter (n-1)/n, broadcast 1), as NCCL's
tests do; send_recv is a blocking ping-pong between rank pairs, its time one way. Two
ceilings are measured first in the same run: a raw single-stream TCP transfer over loopback between ranks 0 and 1 (for tcp and ucx), and a single-thread
memcpy of each size on rank 0 (for shm).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from typing import Callable

import torch
import torch.distributed as dist

import ddlcomm

from bench import init_ranks

OPS = ["all_reduce", "all_gather", "reduce_scatter", "broadcast", "send_recv"]
QUICK_SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20]
FULL_SIZES = [1 << k for k in range(12, 29, 2)]  # 4 KiB .. 256 MiB, x4 steps


def raw_tcp_gbps(nbytes: int = 256 << 20) -> float:
    """One TCP stream over loopback, rank 0 -> rank 1, in GB/s (rank 0's view; 0 elsewhere)."""
    rank = dist.get_rank()
    port_holder = torch.zeros(1, dtype=torch.int64)
    result = torch.zeros(1, dtype=torch.float64)
    chunk = 4 << 20
    if rank == 1:
        server = socket.create_server(("127.0.0.1", 0))
        port_holder[0] = server.getsockname()[1]
    dist.broadcast(port_holder, 1)
    if rank == 0:
        payload = memoryview(bytearray(chunk))
        with socket.create_connection(("127.0.0.1", int(port_holder.item()))) as s:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            start = time.perf_counter()
            for _ in range(nbytes // chunk):
                s.sendall(payload)
            s.shutdown(socket.SHUT_WR)
            s.recv(1)  # the receiver's acknowledgement that it has everything
            result[0] = nbytes / (time.perf_counter() - start) / 1e9
    elif rank == 1:
        conn, _ = server.accept()
        buf = memoryview(bytearray(chunk))
        got = 0
        while got < nbytes:
            n = conn.recv_into(buf)
            if n == 0:
                break
            got += n
        conn.sendall(b"k")
        conn.close()
        server.close()
    dist.barrier()
    return float(result.item())


DEEPSPEED = "deepspeed"  # stands for DeepSpeed's shared-memory all-reduce among the groups
DIRECT = "shm-direct"  # the shm group's all-reduce through ddlcomm.all_reduce_


class Direct:
    """A ddlcomm group whose all-reduce is called through ddlcomm.all_reduce_."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group


def make_op(name: str, nbytes: int, n: int, group) -> tuple[Callable[[], None], float, int] | None:
    """Returns (call, bus-bandwidth factor, element count), None if `group` cannot run it.

    send_recv is a ping-pong between ranks 2i and 2i+1 (blocking dist.send, then dist.recv);
    main() halves its time to one way.
    """
    count = max(1, nbytes // 4)
    if group is DEEPSPEED:
        if name != "all_reduce":
            return None
        import deepspeed.comm as dscomm  # noqa: PLC0415

        t = torch.ones(count)
        return (lambda: dscomm.inference_all_reduce(t)), 2 * (n - 1) / n, count
    if isinstance(group, Direct):
        if name != "all_reduce":
            return None
        t = torch.ones(count)
        return (lambda: ddlcomm.all_reduce_(t, group=group.group)), 2 * (n - 1) / n, count
    if name == "all_reduce":
        t = torch.ones(count)
        return (lambda: dist.all_reduce(t, group=group)), 2 * (n - 1) / n, count
    if name == "broadcast":
        t = torch.ones(count)
        return (lambda: dist.broadcast(t, 0, group=group)), 1.0, count
    if name == "send_recv":
        t = torch.ones(count)
        rank = dist.get_rank()
        partner = rank ^ 1
        if partner >= n:  # the odd rank out of an odd world waits in time_op's barriers
            return (lambda: None), 1.0, count
        first, second = (dist.send, dist.recv) if rank % 2 == 0 else (dist.recv, dist.send)
        return (lambda: (first(t, partner, group=group), second(t, partner, group=group))), 1.0, count
    per_rank = max(1, count // n)
    if name == "all_gather":
        inp, out = torch.ones(per_rank), torch.empty(per_rank * n)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
        return (lambda: gather(out, inp, group=group)), (n - 1) / n, per_rank * n
    if name == "reduce_scatter":
        inp, out = torch.ones(per_rank * n), torch.empty(per_rank)
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor  # renamed in torch 2.13
        return (lambda: scatter(out, inp, group=group)), (n - 1) / n, per_rank * n
    raise ValueError(f"unknown collective {name}")


BATCHES = 7  # a VM's stolen millisecond spoils one batch; the median ignores it


def time_op(call: Callable[[], None], nbytes: int, budget_s: float) -> float:
    """Median seconds per call over BATCHES timed batches, after warm-up."""
    call()
    call()
    dist.barrier()
    start = time.perf_counter()
    call()
    one = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(one, op=dist.ReduceOp.MAX)  # every rank agrees on the iteration count
    iters = int(max(2, min(5000, budget_s / max(float(one.item()), 1e-6) / BATCHES)))
    samples = []
    for _ in range(BATCHES):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            call()
        elapsed = torch.tensor([(time.perf_counter() - start) / iters])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        samples.append(float(elapsed.item()))
    return statistics.median(samples)


def width(backend: str) -> int:
    """Columns of a backend's time: its heading "<name> us" and a space."""
    return max(11, len(backend) + 4)


def human(nbytes: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift:
            return f"{nbytes / (1 << shift):g} {unit}"
    return f"{nbytes} B"


# Argument types: a mistake is reported by argparse before any rank connects or measures.
def op_list(text: str) -> list[str]:
    ops = OPS if text == "all" else text.split(",")
    unknown = [op for op in ops if op not in OPS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown collective {', '.join(map(repr, unknown))}: "
                                         f"choose from {', '.join(OPS)} (comma-separated) or all")
    return ops


def size_list(text: str) -> list[int]:
    try:
        sizes = [int(s) for s in text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of positive byte counts")
    return sizes


def positive_seconds(text: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        seconds = 0.0
    if not seconds > 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of seconds")
    return seconds


def memcpy_gbps(nbytes: int) -> float:
    """Single-thread copy of `nbytes` between two buffers of this process, in GB/s."""
    src, dst = torch.ones(max(1, nbytes // 4)), torch.empty(max(1, nbytes // 4))
    dst.copy_(src)
    iters = max(3, min(1000, (256 << 20) // max(nbytes, 1)))
    start = time.perf_counter()
    for _ in range(iters):
        dst.copy_(src)
    return src.numel() * 4 * iters / (time.perf_counter() - start) / 1e9


def ddlcomm_groups(names: list[str]) -> dict:
    """One ddlcomm group per transport name, each asking for its transport in its pg_options."""
    return {name: dist.new_group(backend="ddlcomm", pg_options=ddlcomm.Options(transport=name)) for name in names}


def transport_list(text: str) -> list[str]:
    names = text.split(",")
    unknown = [t for t in names if t not in ddlcomm.transports()]
    if unknown:
        raise argparse.ArgumentTypeError(f"transport {', '.join(map(repr, unknown))} is not in this build: "
                                         f"choose from {', '.join(ddlcomm.transports())} (comma-separated)")
    return names


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ops", type=op_list, default=OPS,
                        help=f"comma-separated: {', '.join(OPS)} (or 'all', the default)")
    parser.add_argument("--transports", type=transport_list, default=ddlcomm.transports(),
                        help=f"ddlcomm transports to measure (default: all of this build's, {','.join(ddlcomm.transports())})")
    parser.add_argument("--full", action="store_true", help="sizes 4 KiB .. 256 MiB (default: a quick set)")
    parser.add_argument("--sizes", type=size_list, help="comma-separated byte counts, overriding the size set")
    parser.add_argument("--budget", type=positive_seconds, default=0.6, help="seconds per measurement (per backend)")
    parser.add_argument("--deepspeed", action="store_true",
                        help="also measure DeepSpeed's shared-memory all-reduce (deepspeed.comm.inference_all_reduce; "
                             "needs deepspeed installed, DS_ACCELERATOR=cpu and LOCAL_SIZE set)")
    args = parser.parse_args()

    init_ranks("gloo")  # the world group only times and agrees; it is measured too
    backends = {"gloo": dist.group.WORLD, **ddlcomm_groups(args.transports)}
    if "shm" in backends and "all_reduce" in args.ops:
        backends[DIRECT] = Direct(backends["shm"])
    if args.deepspeed:
        import deepspeed  # noqa: PLC0415  (optional, and heavy)

        deepspeed.init_distributed(dist_backend="gloo")  # adopts the initialized default group
        backends["deepspeed"] = DEEPSPEED
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    sizes = args.sizes or (FULL_SIZES if args.full else QUICK_SIZES)

    ceiling = raw_tcp_gbps() if n > 1 else 0.0
    if rank == 0:
        cores = len(os.sched_getaffinity(0))
        print(f"# {n} ranks on this host ({cores} cores); raw single-stream TCP loopback: {ceiling:.2f} GB/s; "
              f"times in us, busbw in GB/s")
        print("# " + f"{'collective':<13}{'size':>9}" + "".join(f"{b + ' us':>{width(b)}}{'busbw':>7}" for b in backends)
              + "".join(f"{t + '/gloo':>10}" for t in args.transports)
              + ("   shm/tcp  memcpy  shm/memcpy" if {"shm", "tcp"} <= set(args.transports) else "")
              + ("  shm/deepspeed  direct/deepspeed" if args.deepspeed and DIRECT in backends else ""))
        print("# X us: time per call (lower is better); busbw: bus bandwidth (higher is better); "
              "T/gloo: gloo's time over T's (above 1x, ddlcomm's T is faster)")
        if "ucx" in args.transports:
            print("# ucx: UCX over the transports UCX_TLS allows (tcp on a host without RDMA NICs), at times below "
                  "gloo here: docs/results/transports.md, \"Where UCX over tcp loses its time\"")
        if {"shm", "tcp"} <= set(args.transports):
            print(f"# {DIRECT}: shm's all-reduce through ddlcomm.all_reduce_ (no c10d dispatch); memcpy: "
                  "single-thread memcpy GB/s of that size, shm's ceiling; shm/memcpy: shm's busbw as a share of it")
    for op in args.ops:
        for nbytes in sizes:
            times = {}
            for backend, group in backends.items():
                made = make_op(op, nbytes, n, group)
                if made is None:
                    times[backend] = float("nan")
                    continue
                call, factor, count = made
                times[backend] = time_op(call, nbytes, args.budget) / (2 if op == "send_recv" else 1)
            copy = memcpy_gbps(count * 4) if rank == 0 else 0.0
            dist.barrier()
            if rank == 0:
                actual = count * 4
                busbw = {b: actual / t / 1e9 * factor for b, t in times.items()}
                row = f"  {op:<13}{human(actual):>9}" + "".join(f"{times[b] * 1e6:>{width(b)}.1f}{busbw[b]:>7.2f}" for b in backends)
                row += "".join(f"{times['gloo'] / times[t]:>9.2f}x" for t in args.transports)
                if {"shm", "tcp"} <= set(args.transports):
                    row += f"{times['tcp'] / times['shm']:>9.2f}x{copy:>8.2f}{busbw['shm'] / copy:>11.0%}"
                if args.deepspeed and DIRECT in backends:
                    row += f"{times['deepspeed'] / times['shm']:>14.2f}x{times['deepspeed'] / times[DIRECT]:>17.2f}x"
                print(row, flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
