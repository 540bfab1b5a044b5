"""Writes docs/support-matrix.md: which collective, dtype and reduce op each backend accepts,
found by calling them (2 ranks on this machine, ddlcomm and gloo side by side), not by hand.

    python scripts/support_matrix.py                 # rewrite docs/support-matrix.md
    python scripts/support_matrix.py --check         # exit 1 if the file is out of date

A cell is "ok" when the call returns a correct result (checked against a plain computation),
else the exception type it raises, "wrong" for a wrong result, or "accepted, undefined" when
the op means nothing for the dtype (bitwise ops on floats) and the call ran anyway.
"""

from __future__ import annotations

import argparse
import os
import queue as queue_module
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

DOC = Path(__file__).resolve().parent.parent / "docs" / "support-matrix.md"
WORLD = 2
DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
    torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.uint16, torch.uint32, torch.uint64,
    torch.bool, torch.float8_e4m3fn, torch.float8_e5m2,
]
OPS = ["SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"]
REDUCING = ["all_reduce", "reduce", "reduce_scatter"]
MOVING = ["broadcast", "all_gather", "all_to_all", "gather", "scatter", "send/recv"]


def _value(rank: int, dtype: torch.dtype) -> torch.Tensor:
    """Small values every dtype holds exactly: rank + 1 in each of 4 elements (True for bool)."""
    return torch.full((4,), rank + 1, dtype=torch.float32).to(dtype)


def _expected(op: str, dtype: torch.dtype) -> torch.Tensor | None:
    """The reduction in a wide dtype of the same kind, or None where the op is undefined."""
    wide = (torch.complex128 if dtype.is_complex else torch.float64 if dtype.is_floating_point
            else torch.bool if dtype == torch.bool else torch.int64)
    a, b = (_value(r, dtype).to(wide) for r in range(WORLD))
    try:
        return {
            "SUM": lambda: a + b, "AVG": lambda: (a + b) / WORLD, "PRODUCT": lambda: a * b,
            "MIN": lambda: torch.minimum(a, b), "MAX": lambda: torch.maximum(a, b),
            "BAND": lambda: a & b, "BOR": lambda: a | b, "BXOR": lambda: a ^ b,
        }[op]()
    except (RuntimeError, TypeError, NotImplementedError):
        return None


def _same(actual: torch.Tensor, expected: torch.Tensor | None) -> bool:
    return expected is not None and torch.equal(actual.to(expected.dtype), expected)


def _reducing(name: str, op: str, dtype: torch.dtype, rank: int) -> str:
    x = _value(rank, dtype)
    reduce_op = getattr(dist.ReduceOp, op)
    want = _expected(op, dtype)
    if name == "all_reduce":
        dist.all_reduce(x, op=reduce_op)
        return _verdict(_same(x, want), want)
    if name == "reduce":
        dist.reduce(x, dst=0, op=reduce_op)
        return _verdict(rank != 0 or _same(x, want), want)
    out = torch.empty(2, dtype=dtype)
    dist.reduce_scatter_tensor(out, x, op=reduce_op) if not hasattr(dist, "reduce_scatter_single") else \
        dist.reduce_scatter_single(out, x, op=reduce_op)
    return _verdict(want is not None and _same(out, want[:2]), want)


def _verdict(correct: bool, want: torch.Tensor | None) -> str:
    if want is None:
        return "accepted, undefined"  # the op means nothing for this dtype, yet it ran
    return "ok" if correct else "wrong"


def _moving(name: str, dtype: torch.dtype, rank: int) -> str:
    x = _value(rank, dtype)
    every = [_value(r, dtype) for r in range(WORLD)]
    if name == "broadcast":
        dist.broadcast(x, src=0)
        return "ok" if torch.equal(x, every[0]) else "wrong"
    if name == "all_gather":
        out = [torch.empty_like(x) for _ in range(WORLD)]
        dist.all_gather(out, x)
        return "ok" if all(torch.equal(a, b) for a, b in zip(out, every)) else "wrong"
    if name == "all_to_all":
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x)
        return "ok" if torch.equal(out, torch.cat([e[rank * 2: rank * 2 + 2] for e in every])) else "wrong"
    if name == "gather":
        out = [torch.empty_like(x) for _ in range(WORLD)] if rank == 0 else None
        dist.gather(x, out, dst=0)
        return "ok" if rank != 0 or all(torch.equal(a, b) for a, b in zip(out, every)) else "wrong"
    if name == "scatter":
        out = torch.empty_like(x)
        dist.scatter(out, every if rank == 0 else None, src=0)
        return "ok" if torch.equal(out, every[rank]) else "wrong"
    if rank == 0:
        dist.send(x, dst=1)
        return "ok"
    out = torch.empty_like(x)
    dist.recv(out, src=0)
    return "ok" if torch.equal(out, every[0]) else "wrong"


def _probe(call) -> str:
    try:
        return call()
    except Exception as error:  # noqa: BLE001  (the type is the answer)
        return type(error).__name__


def _rank(rank: int, backend: str, store_path: str, queue) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import ddlcomm  # noqa: F401

    store = dist.FileStore(store_path, WORLD)
    cells = {}
    for index, dtype in enumerate(DTYPES):
        # A fresh group per dtype: a call refused on one rank only can leave the other's
        # connection mid-collective (gloo then fails a later call, even a barrier, at random).
        dist.init_process_group(backend, store=dist.PrefixStore(f"dtype{index}", store), rank=rank, world_size=WORLD)
        for name in REDUCING:
            for op in OPS:
                cells[(name, op, str(dtype))] = _probe(lambda: _reducing(name, op, dtype, rank))
        for name in MOVING:
            cells[(name, "", str(dtype))] = _probe(lambda: _moving(name, dtype, rank))
        dist.destroy_process_group()
    if rank == 0:
        queue.put(cells)


def probe(backend: str) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_rank, args=(r, backend, f"{tmp}/store", queue)) for r in range(WORLD)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + 600
        while True:  # a rank that dies must fail the probe now, not after the deadline
            try:
                cells = queue.get(timeout=1)
                break
            except queue_module.Empty:
                codes = [p.exitcode for p in procs]
                if all(c is not None for c in codes) or any(c not in (None, 0) for c in codes) \
                        or time.monotonic() > deadline:
                    for p in procs:
                        p.kill()
                    raise RuntimeError(f"{backend}: the ranks gave no result (exit codes {codes})")
        for p in procs:
            p.join(timeout=60)
    return cells


def render(ours: dict, gloo: dict) -> str:
    def cell(key) -> str:
        a, b = ours[key], gloo[key]
        return a if (a == "ok") == (b == "ok") else f"**{a}** (gloo: {b})"

    lines = [
        "# Support matrix",
        "",
        "Generated by `python scripts/support_matrix.py` (tests/test_docs.py checks it is current): every",
        f"collective called with every dtype and reduce op on {WORLD} CPU ranks, on ddlcomm and on gloo.",
        "`ok` means the result was checked against a plain computation; otherwise the exception",
        "raised (`accepted, undefined`: the op means nothing for the dtype, yet the call ran).",
        "Cells where one backend accepts what the other refuses are in bold, with gloo's answer.",
        "Tensors on other devices are refused with ValueError (ddlcomm is a CPU backend).",
        "",
    ]
    for name in REDUCING:
        lines += [f"## {name}", "", "| dtype | " + " | ".join(OPS) + " |", "|---" * (len(OPS) + 1) + "|"]
        for dtype in DTYPES:
            lines.append(f"| {str(dtype)[6:]} | " + " | ".join(cell((name, op, str(dtype))) for op in OPS) + " |")
        lines.append("")
    lines += ["## Collectives that move data", "", "| dtype | " + " | ".join(MOVING) + " |",
              "|---" * (len(MOVING) + 1) + "|"]
    for dtype in DTYPES:
        lines.append(f"| {str(dtype)[6:]} | " + " | ".join(cell((name, "", str(dtype))) for name in MOVING) + " |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/support-matrix.md is out of date")
    args = parser.parse_args()
    text = render(probe("ddlcomm"), probe("gloo"))
    if args.check:
        if DOC.read_text() != text:
            sys.stderr.write(f"{DOC} is out of date: run python scripts/support_matrix.py\n")
            return 1
        return 0
    DOC.write_text(text)
    print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
