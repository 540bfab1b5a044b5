"""Throughput of the ddlcomm compressors against the same algorithms in plain torch ops and memcpy.

    python -m bench.compress_kernels            # quick: 1, 16, 64 MiB of float32 input
    python -m bench.compress_kernels --full     # 1 MiB .. 256 MiB
    python -m bench.compress_kernels --sizes 4 32 --threads 1

GB/s are of float32 input (4 bytes per element) for every column. "/thread" divides by the
threads ddlcomm used (DDLCOMM_NUM_THREADS or the core count, at most one per 1 Mi elements);
memcpy is torch's dst.copy_(src) on one thread (torch.set_num_threads(1)), so "%memcpy" compares
per-thread bandwidths; it is timed in the same rounds as the ddlcomm calls it is compared with.
ddlcomm encodes into a reused payload buffer (encode(..., out=)); the torch-ops references run on
as many threads as ddlcomm uses. Each number is the best of --reps rounds: on a shared machine
the best is the least disturbed.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time
from typing import Callable, Iterator

import torch

from ddlcomm.compressors import BF16, FP16, Compressor, OneBit, RandomK, Ternary, TopK

MiB = 1 << 20
BLOCK = 256
RATIO = 0.01


def timed(*fns: Callable[[], object], reps: int) -> list[float]:
    """Best seconds of each function over `reps` rounds that call them in turn (after a warm-up),
    so that numbers compared with each other were taken under the same machine load."""
    best = [float("inf")] * len(fns)
    for fn in fns:
        fn()
    for _ in range(reps):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - start)
    return best


def ddlcomm_threads(numel: int) -> int:
    """Threads ddlcomm spawns for a pass over numel elements (csrc/compress/parallel.cc)."""
    threads = int(os.environ.get("DDLCOMM_NUM_THREADS", "0") or 0) or os.cpu_count() or 1
    return max(1, min(threads, numel // MiB, 256))


# ---- the same algorithms in plain torch ops ---------------------------------------------------------

BIT_WEIGHTS = torch.tensor([1 << i for i in range(8)], dtype=torch.uint8)
CODE_SHIFTS = torch.tensor([0, 2, 4, 6], dtype=torch.uint8)


def torch_one_bit(x: torch.Tensor, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    y = x + r
    scale = y.abs().view(-1, BLOCK).mean(1)
    signs = y >= 0
    decoded = torch.where(signs.view(-1, BLOCK), scale[:, None], -scale[:, None]).view(-1)
    torch.sub(y, decoded, out=r)
    return scale, (signs.view(-1, 8).to(torch.uint8) * BIT_WEIGHTS).sum(1, dtype=torch.uint8)


def torch_one_bit_decode_acc(payload: tuple[torch.Tensor, torch.Tensor], out: torch.Tensor) -> None:
    scale, bits = payload
    signs = (bits[:, None] & BIT_WEIGHTS).ne(0).view(-1, BLOCK)
    out += torch.where(signs, scale[:, None], -scale[:, None]).view(-1)


def torch_ternary(x: torch.Tensor, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    y = x + r
    a = y.abs().view(-1, BLOCK)
    send = a > 0.7 * a.mean(1, keepdim=True)
    scale = (a * send).sum(1) / send.sum(1).clamp_min(1)
    codes = torch.where(send, torch.where(y.view(-1, BLOCK) >= 0, 1, 2), 0).to(torch.uint8).view(-1)
    decoded = torch.where(send, y.view(-1, BLOCK).sign() * scale[:, None], 0).view(-1)
    torch.sub(y, decoded, out=r)
    return scale, (codes.view(-1, 4) << CODE_SHIFTS).sum(1, dtype=torch.uint8)


def torch_stochastic_ternary(x: torch.Tensor, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    y = x + r
    scale = y.abs().view(-1, BLOCK).amax(1)
    send = torch.rand_like(y).view(-1, BLOCK) * scale[:, None] < y.abs().view(-1, BLOCK)
    codes = torch.where(send, torch.where(y.view(-1, BLOCK) >= 0, 1, 2), 0).to(torch.uint8).view(-1)
    decoded = torch.where(send, y.view(-1, BLOCK).sign() * scale[:, None], 0).view(-1)
    torch.sub(y, decoded, out=r)
    return scale, (codes.view(-1, 4) << CODE_SHIFTS).sum(1, dtype=torch.uint8)


def torch_ternary_decode_acc(payload: tuple[torch.Tensor, torch.Tensor], out: torch.Tensor) -> None:
    scale, packed = payload
    codes = ((packed[:, None] >> CODE_SHIFTS) & 3).view(-1, BLOCK)
    out += torch.where(codes == 1, scale[:, None], torch.where(codes == 2, -scale[:, None], 0)).view(-1)


def torch_top_k(x: torch.Tensor, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    y = x + r
    index = torch.topk(y.abs(), max(1, round(RATIO * y.numel())), sorted=False).indices.sort().values
    values = y[index]
    r.copy_(y)
    r[index] = 0
    return index.int(), values


def torch_top_k_2bit(x: torch.Tensor, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k with 2-bit value codes (TopK(value_bits=2)): sign and an equal-count magnitude
    half by rank; each code decodes to its entries' mean."""
    index, values = torch_top_k(x, r)
    k = values.numel()
    rank = torch.empty(k, dtype=torch.int64)
    rank[values.abs().argsort(descending=True, stable=True)] = torch.arange(k)
    code = rank * 2 // k + (values < 0) * 2
    table = torch.zeros(4, dtype=torch.float64).index_add_(0, code, values.double())
    table = (table / torch.bincount(code, minlength=4).clamp_min(1)).float()
    r[index] = values - table[code]
    padded = torch.nn.functional.pad(code.to(torch.uint8), (0, -k % 4))
    return index, table, (padded.view(-1, 4) << CODE_SHIFTS).sum(1, dtype=torch.uint8)


def torch_coded_decode_acc(payload: tuple[torch.Tensor, torch.Tensor, torch.Tensor], out: torch.Tensor) -> None:
    index, table, packed = payload
    codes = ((packed[:, None] >> CODE_SHIFTS) & 3).view(-1)[: index.numel()]
    out.index_add_(0, index, table[codes.long()])


def torch_random_k(x: torch.Tensor, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    y = x + r
    index = torch.randperm(y.numel())[: max(1, round(RATIO * y.numel()))].sort().values
    values = y[index]
    r.copy_(y)
    r[index] = 0
    return index.int(), values


def torch_sparse_decode_acc(payload: tuple[torch.Tensor, torch.Tensor], out: torch.Tensor) -> None:
    index, values = payload
    out.index_add_(0, index, values)


def torch_cast(dtype: torch.dtype) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    def encode(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        y = x + r
        h = y.to(dtype)
        torch.sub(y, h.float(), out=r)
        return h

    return encode


def torch_cast_decode_acc(payload: torch.Tensor, out: torch.Tensor) -> None:
    out += payload.float()


CASES: list[tuple[str, Callable[[], Compressor], Callable, Callable]] = [
    ("1-bit", lambda: OneBit(BLOCK), torch_one_bit, torch_one_bit_decode_acc),
    ("ternary", lambda: Ternary(BLOCK), torch_ternary, torch_ternary_decode_acc),
    ("ternary stochastic", lambda: Ternary(BLOCK, stochastic=True), torch_stochastic_ternary, torch_ternary_decode_acc),
    ("top-k 1%", lambda: TopK(RATIO), torch_top_k, torch_sparse_decode_acc),
    ("top-k 1% approx", lambda: TopK(RATIO, approximate=True), torch_top_k, torch_sparse_decode_acc),
    ("top-k 1% 2-bit", lambda: TopK(RATIO, value_bits=2), torch_top_k_2bit, torch_coded_decode_acc),
    ("random-k 1%", lambda: RandomK(RATIO), torch_random_k, torch_sparse_decode_acc),
    ("fp16", FP16, torch_cast(torch.float16), torch_cast_decode_acc),
    ("bf16", BF16, torch_cast(torch.bfloat16), torch_cast_decode_acc),
]


@contextlib.contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def bench_size(size_mib: int, reps: int, only: set[str] | None) -> None:
    numel = size_mib * MiB // 4
    x = torch.randn(numel, generator=torch.Generator().manual_seed(0))
    copy_dst = torch.empty_like(x)
    threads = ddlcomm_threads(numel)
    gb = x.nbytes / 1e9
    print(f"\n{size_mib} MiB float32 ({numel} elements): ddlcomm and torch threads {threads}")
    print(f"{'compressor':<16} | {'encode+EF':>9} {'torch':>6} {'x torch':>7} {'/thread':>7} {'memcpy':>6} "
          f"{'%memcpy':>7} | {'dec-acc':>7} {'torch':>6} {'x torch':>7} {'/thread':>7} {'%memcpy':>7}")
    for name, make, torch_encode, torch_decode_acc in CASES:
        if only and name not in only:
            continue
        compressor = make()
        residual, out = torch.zeros(numel), torch.zeros(numel)
        stream = iter(range(1 << 62))
        payload = torch.empty(compressor.compressed_nbytes(numel), dtype=torch.uint8)  # reused, as a DDP hook would
        with torch_threads(1):  # the memcpy baseline; ddlcomm's threads do not depend on torch's
            encode_s, decode_s, memcpy_s = timed(
                lambda: compressor.encode(x, residual, stream=next(stream), out=payload),
                lambda: compressor.decode_accumulate(payload, out),
                lambda: copy_dst.copy_(x),
                reps=reps)
        torch_residual = torch.zeros(numel)
        with torch_threads(threads):
            torch_payload = torch_encode(x, torch_residual)
            torch_encode_s, torch_decode_s = timed(lambda: torch_encode(x, torch_residual),
                                                   lambda: torch_decode_acc(torch_payload, out), reps=reps)
        enc, dec, memcpy = gb / encode_s, gb / decode_s, gb / memcpy_s
        print(f"{name:<16} | {enc:9.2f} {gb / torch_encode_s:6.2f} {torch_encode_s / encode_s:7.1f} "
              f"{enc / threads:7.2f} {memcpy:6.2f} {100 * enc / threads / memcpy:6.0f}% | {dec:7.2f} "
              f"{gb / torch_decode_s:6.2f} {torch_decode_s / decode_s:7.1f} {dec / threads:7.2f} "
              f"{100 * dec / threads / memcpy:6.0f}%")


def bench_top_k_vs_torch(size_mib: int, reps: int) -> None:
    numel = size_mib * MiB // 4
    x = torch.randn(numel, generator=torch.Generator().manual_seed(1))
    k = TopK(RATIO).kept_entries(numel)
    print(f"\ntop-k {RATIO:.0%} of {size_mib} MiB (k = {k}), best of {reps} rounds, "
          f"ddlcomm and torch threads {ddlcomm_threads(numel)}:")
    residual = torch.zeros(numel)
    rows = [
        ("torch.topk(x.abs(), k)", lambda: torch.topk(x.abs(), k, sorted=False)),
        ("torch ops top-k + EF", lambda: torch_top_k(x, residual)),
        ("ddlcomm exact + EF", lambda: TopK(RATIO).encode(x, residual)),
        ("ddlcomm approx + EF", lambda: TopK(RATIO, approximate=True).encode(x, residual)),
        ("ddlcomm approx, no EF", lambda: TopK(RATIO, approximate=True).encode(x)),
    ]
    with torch_threads(ddlcomm_threads(numel)):
        seconds = timed(*(fn for _, fn in rows), reps=reps)
    for (name, _), s in zip(rows, seconds):
        print(f"  {name:<24} {s:8.4f} s   {seconds[0] / s:6.1f}x vs torch.topk")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--full", action="store_true", help="sizes 1, 4, 16, 64, 256 MiB")
    parser.add_argument("--sizes", type=int, nargs="+", metavar="MIB", help="input sizes in MiB")
    parser.add_argument("--reps", type=int, default=5, help="timed rounds per measurement (the best counts)")
    parser.add_argument("--only", nargs="+", help="compressor names to run (as printed)")
    parser.add_argument("--threads", type=int, help="ddlcomm threads (sets DDLCOMM_NUM_THREADS, read on every call)")
    args = parser.parse_args()
    if args.threads:
        os.environ["DDLCOMM_NUM_THREADS"] = str(args.threads)
    sizes = args.sizes or ([1, 4, 16, 64, 256] if args.full else [1, 16, 64])
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, "
          f"DDLCOMM_NUM_THREADS={os.environ.get('DDLCOMM_NUM_THREADS', '(unset)')}")
    for size in sizes:
        bench_size(size, args.reps, set(args.only) if args.only else None)
    # The top-k section belongs to top-k: run it when --only names one (or is not given).
    if not args.only or any(name.startswith("top-k") for name in args.only):
        bench_top_k_vs_torch(64, max(3, args.reps // 2))


if __name__ == "__main__":
    main()
