"""Collective microbenchmark: ddlcomm and gloo side by side, in the same run.

Run under torchrun, e.g.::

    torchrun --standalone --nproc-per-node 4 -m ddlcomm.bench.collectives --ops all_reduce

Rank 0 prints, for each collective and size, what NCCL's tests print (size, count,
dtype, time, algorithm bandwidth, bus bandwidth) for both backends and the ratio. Bus
bandwidth normalizes by how much each rank must move: all-reduce 2(n-1)/n,
all-gather and reduce-scatter (n-1)/n, broadcast 1. The ceiling is a raw single-stream
TCP transfer over loopback between ranks 0 and 1, measured first in the same run.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import time
from typing import Callable

import torch
import torch.distributed as dist

import ddlcomm  # noqa: F401

OPS = ["all_reduce", "all_gather", "reduce_scatter", "broadcast"]
QUICK_SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20]
FULL_SIZES = [1 << k for k in range(10, 29, 2)]  # 1 KiB .. 256 MiB, x4 steps


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


def make_op(name: str, nbytes: int, n: int, group) -> tuple[Callable[[], None], float, int]:
    """Returns (call, bus-bandwidth factor, element count)."""
    count = max(1, nbytes // 4)
    if name == "all_reduce":
        t = torch.ones(count)
        return (lambda: dist.all_reduce(t, group=group)), 2 * (n - 1) / n, count
    if name == "broadcast":
        t = torch.ones(count)
        return (lambda: dist.broadcast(t, 0, group=group)), 1.0, count
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


def time_op(call: Callable[[], None], nbytes: int, budget_s: float) -> float:
    """Median seconds per call over a few timed batches, after warm-up."""
    call()
    call()
    dist.barrier()
    start = time.perf_counter()
    call()
    one = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(one, op=dist.ReduceOp.MAX)  # every rank agrees on the iteration count
    iters = int(max(2, min(200, budget_s / max(float(one.item()), 1e-6) / 3)))
    samples = []
    for _ in range(3):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            call()
        elapsed = torch.tensor([(time.perf_counter() - start) / iters])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        samples.append(float(elapsed.item()))
    return statistics.median(samples)


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ops", type=op_list, default=OPS,
                        help=f"comma-separated: {', '.join(OPS)} (or 'all', the default)")
    parser.add_argument("--full", action="store_true", help="sizes 1 KiB .. 256 MiB (default: a quick set)")
    parser.add_argument("--sizes", type=size_list, help="comma-separated byte counts, overriding the size set")
    parser.add_argument("--budget", type=positive_seconds, default=0.6, help="seconds per measurement (per backend)")
    args = parser.parse_args()

    dist.init_process_group("ddlcomm")
    gloo = dist.new_group(backend="gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    sizes = args.sizes or (FULL_SIZES if args.full else QUICK_SIZES)

    ceiling = raw_tcp_gbps() if n > 1 else 0.0
    if rank == 0:
        print(f"# {n} ranks on this host; raw single-stream TCP loopback: {ceiling:.2f} GB/s")
        print(f"# {'collective':<15}{'size':>10}{'count':>11}  dtype    "
              f"{'gloo us':>10}{'busbw':>8}  {'ddlcomm us':>10}{'algbw':>8}{'busbw':>8}  {'speedup':>7}  {'of TCP':>6}")
    for op in args.ops:
        for nbytes in sizes:
            times = {}
            for backend, group in (("gloo", gloo), ("ddlcomm", None)):
                call, factor, count = make_op(op, nbytes, n, group)
                times[backend] = time_op(call, nbytes, args.budget)
            if rank == 0:
                actual = count * 4
                algbw = {b: actual / t / 1e9 for b, t in times.items()}
                busbw = {b: v * factor for b, v in algbw.items()}
                of_tcp = f"{busbw['ddlcomm'] / ceiling:6.0%}" if ceiling else "     -"
                print(f"  {op:<15}{human(actual):>10}{count:>11}  float32  "
                      f"{times['gloo'] * 1e6:>10.1f}{busbw['gloo']:>8.2f}  "
                      f"{times['ddlcomm'] * 1e6:>10.1f}{algbw['ddlcomm']:>8.2f}{busbw['ddlcomm']:>8.2f}  "
                      f"{times['gloo'] / times['ddlcomm']:>6.2f}x  {of_tcp}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
