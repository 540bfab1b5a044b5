"""Plain-torch versions of the ddlcomm GPU compressors (encode + error feedback), timed with
torch.cuda.Event, side by side with the CUDA kernels' numbers from bench_cuda_kernels.

    python -m bench.cuda.torch_ops [--bench build/cuda/bench_cuda_kernels] [--sizes-mib 1,16,64,256]
                                           [--csv out.csv] [--reps 10]

The torch versions compute the same things the kernels do (block means / maxima, sign and
2-bit packing, the residual update), written the way one would in torch, without custom
kernels. They are the baseline docs/cuda.md compares with; the last line sets approximate top-k
1% of 256 MiB against torch.topk and against the memory floor of any encode with error feedback
(x and the residual read, the residual written: 1.5 device-to-device copies of x). With --bench, the CUDA
benchmark runs first (same sizes) and the table shows both times and the speedup.
It imports torch only, so it also runs by its path (python3 bench/cuda/torch_ops.py)
where the extension is not built yet, as in scripts/gpu_check.sh.
"""

import argparse
import csv
import os
import statistics
import subprocess
import sys

import torch


def timed(fn, reps):
    """Median milliseconds of fn() over reps runs (CUDA events), after 3 warm-ups."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def pack_bits(bits_u8, per_byte):
    """Packs per_byte small codes (bits wide: 8 // per_byte) little-endian into uint8."""
    width = 8 // per_byte
    n = bits_u8.numel()
    pad = (-n) % per_byte
    if pad:
        bits_u8 = torch.cat([bits_u8, bits_u8.new_zeros(pad)])
    shifts = torch.arange(per_byte, device=bits_u8.device, dtype=torch.uint8) * width
    return (bits_u8.view(-1, per_byte) << shifts).sum(dim=1, dtype=torch.uint8)


def blocked(y, block):
    pad = (-y.numel()) % block
    return torch.nn.functional.pad(y, (0, pad)).view(-1, block), pad


def onebit(x, r, block=256):
    y = x + r
    yb, pad = blocked(y, block)
    count = torch.full((yb.shape[0],), float(block), device=y.device)
    if pad:
        count[-1] = block - pad
    scale = yb.abs().sum(dim=1) / count
    signs = (y >= 0)
    payload = pack_bits(signs.to(torch.uint8), 8)
    decoded = torch.where(signs.view(-1), scale.repeat_interleave(block)[: y.numel()], -scale.repeat_interleave(block)[: y.numel()])
    r.copy_(y - decoded)
    return scale, payload


def onebit_two_scales(x, r, block=256):
    y = x + r
    yb, _ = blocked(y, block)
    pos = yb >= 0
    npos = pos.sum(dim=1).clamp(min=1)
    nneg = (~pos).sum(dim=1).clamp(min=1)
    sp = torch.where(pos, yb, 0).sum(dim=1) / npos
    sn = torch.where(pos, 0, -yb).sum(dim=1) / nneg
    payload = pack_bits((y >= 0).to(torch.uint8), 8)
    decoded = torch.where(pos, sp[:, None], -sn[:, None]).view(-1)[: y.numel()]
    r.copy_(y - decoded)
    return torch.stack([sp, sn], 1), payload


def ternary(x, r, block=256):
    y = x + r
    yb, _ = blocked(y, block)
    s = yb.abs().amax(dim=1, keepdim=True)
    p = yb.abs() / s
    keep = torch.rand_like(p) < p
    code = torch.where(keep, torch.where(yb > 0, 1, 2), 0).to(torch.uint8).view(-1)[: y.numel()]
    payload = pack_bits(code, 4)
    decoded = torch.where(keep, torch.sign(yb) * s, 0).view(-1)[: y.numel()]
    r.copy_(y - decoded)
    return s, payload


def topk_exact(x, r, ratio=0.01):
    y = x + r
    k = max(1, int(y.numel() * ratio))
    _, idx = torch.topk(y.abs(), k, sorted=False)
    idx, _ = torch.sort(idx)
    values = y[idx]
    r.copy_(y)
    r[idx] = 0
    return idx.to(torch.int32), values


def topk_approx(x, r, ratio=0.01, sample=65536):
    """Deep Gradient Compression's recipe: threshold from a sample, exact top-k among candidates."""
    y = x + r
    n = y.numel()
    k = max(1, int(n * ratio))
    a = y.abs()
    pos = torch.randint(0, n, (min(sample, n),), device=y.device)
    s = a[pos]
    rank = min(s.numel(), int(1.25 * k * s.numel() / n) + 8)
    t = torch.topk(s, rank, sorted=False).values.min()
    cand = torch.nonzero(a >= t).view(-1)
    if cand.numel() >= k:
        _, sel = torch.topk(a[cand], k, sorted=False)
        idx, _ = torch.sort(cand[sel])
    else:
        _, idx = torch.topk(a, k, sorted=False)
        idx, _ = torch.sort(idx)
    values = y[idx]
    r.copy_(y)
    r[idx] = 0
    return idx.to(torch.int32), values


def randomk(x, r, ratio=0.01):
    y = x + r
    n = y.numel()
    k = max(1, int(n * ratio))
    j = torch.arange(k, device=y.device, dtype=torch.int64)
    lo = j * n // k
    hi = (j + 1) * n // k
    idx = lo + (torch.rand(k, device=y.device) * (hi - lo)).to(torch.int64)
    values = y[idx]
    r.copy_(y)
    r[idx] = 0
    return idx.to(torch.int32), values


def cast16(dtype):
    def run(x, r):
        y = x + r
        h = y.to(dtype)
        r.copy_(y - h.float())
        return h
    return run


COMPRESSORS = {
    "onebit": onebit,
    "onebit-2scale": onebit_two_scales,
    "ternary": ternary,
    "topk-1%": topk_exact,
    "topk-approx-1%": topk_approx,
    "randomk-1%": randomk,
    "fp16": cast16(torch.float16),
    "bf16": cast16(torch.bfloat16),
}


def run_cuda_bench(path, sizes):
    """Runs bench_cuda_kernels over the same sizes and returns {(mib, name): encode_ms}."""
    out = {}
    csv_path = "bench_cuda_for_torch.csv"
    lo, hi = min(sizes), max(sizes)
    cmd = [path, f"--min-mib={lo}", f"--max-mib={hi}", f"--csv={csv_path}"]
    print("running:", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    with open(csv_path) as f:
        for row in csv.DictReader(f):
            out[(int(row["mib"]), row["compressor"])] = float(row["encode_ms"])
    os.remove(csv_path)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bench", help="path of bench_cuda_kernels, to print the CUDA numbers alongside")
    ap.add_argument("--sizes-mib", default="1,16,64,256", help="comma-separated tensor sizes, MiB")
    ap.add_argument("--reps", type=int, default=10, help="timed repetitions per size")
    ap.add_argument("--csv", help="write the table here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("SKIP: torch sees no CUDA device")
        return 77
    sizes = [int(s) for s in args.sizes_mib.split(",")]
    # CUDA sizes go 1, 4, 16, ... MiB: keep the torch sizes on that grid.
    sizes = [s for s in sizes if s >= 1 and (s & (s - 1)) == 0 and (s.bit_length() - 1) % 2 == 0]
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    cuda_ms = run_cuda_bench(args.bench, sizes) if args.bench else {}

    rows = []
    print(f"{'size':>9} {'kernel':<15} {'torch ms':>10} {'ddlcomm ms':>11} {'speedup':>8}")
    g = torch.Generator(device="cuda")
    g.manual_seed(0)
    for mib in sizes:
        n = mib << 18
        x = torch.rand(n, device="cuda", generator=g) * 2 - 1
        copy_dst = torch.empty_like(x)
        copy_ms = timed(lambda: copy_dst.copy_(x), args.reps)
        print(f"{mib:>5} MiB {'d2d-copy':<15} {copy_ms:>10.3f}")
        for name, fn in COMPRESSORS.items():
            r = torch.zeros_like(x)
            ms = timed(lambda: fn(x, r), args.reps)
            ours = cuda_ms.get((mib, name))
            speed = f"{ms / ours:7.1f}x" if ours else ""
            ours_s = f"{ours:11.3f}" if ours else f"{'':>11}"
            print(f"{mib:>5} MiB {name:<15} {ms:>10.3f} {ours_s} {speed}", flush=True)
            rows.append({"mib": mib, "kernel": name, "torch_ms": ms, "ddlcomm_ms": ours or "",
                         "speedup": (ms / ours) if ours else ""})
        del x, copy_dst
        torch.cuda.empty_cache()

    # torch.topk on 256 MiB of float32, k = 1%, against the approximate top-k kernel.
    n = 256 << 18
    x = torch.rand(n, device="cuda", generator=g) * 2 - 1
    k = n // 100
    topk_ms = timed(lambda: torch.topk(x.abs(), k, sorted=False), args.reps)
    copy_dst = torch.empty_like(x)
    floor_ms = 1.5 * timed(lambda: copy_dst.copy_(x), args.reps)
    ours = cuda_ms.get((256, "topk-approx-1%"))
    line = f"torch.topk(|x|, 1%) on 256 MiB: {topk_ms:.3f} ms"
    if ours:
        line += f"; ddlcomm topk-approx-1% encode+EF: {ours:.3f} ms; speedup {topk_ms / ours:.1f}x"
    line += (f"; an encode+EF at the memory floor ({floor_ms:.3f} ms) would be {topk_ms / floor_ms:.1f}x")
    print(line)
    rows.append({"mib": 256, "kernel": "torch.topk", "torch_ms": topk_ms, "ddlcomm_ms": ours or "",
                 "speedup": (topk_ms / ours) if ours else ""})
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0].keys()))
            w.writeheader()
            w.writerows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
