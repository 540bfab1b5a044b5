"""The kinds of operation of the soak (tests/workers/soak.py), one method each: it draws the
operation's parameters from the shared sequence, issues the collective, and returns a Pending
whose check compares every result this rank holds with the reference (soak_reference.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.distributed as dist

from common import OPS
from ddlcomm import compressors
from ddlcomm.compressed import compressed_all_reduce, server_residual_numel
from soak_reference import digest, fold

MiB = 1 << 20
COMPRESSED_DTYPES = [torch.float32, torch.float16, torch.bfloat16]
COMPRESSORS: dict[str, Callable[[], compressors.Compressor]] = {
    "onebit": compressors.OneBit,
    "onebit_two_scales_b64": lambda: compressors.OneBit(block_size=64, two_scales=True),
    "ternary": lambda: compressors.Ternary(),
    "ternary_b37": lambda: compressors.Ternary(block_size=37),
    "ternary_stochastic_clip_b37": lambda: compressors.Ternary(block_size=37, stochastic=True, clip=1.5, seed=4),
    "topk": lambda: compressors.TopK(ratio=0.05),
    "topk_approx": lambda: compressors.TopK(ratio=0.05, approximate=True),
    "randomk": lambda: compressors.RandomK(ratio=0.05, seed=5),
    "randomk_scaled": lambda: compressors.RandomK(ratio=0.1, seed=6, scaled=True),
    "fp16": compressors.FP16,
    "bf16": compressors.BF16,
}
STRIDED_MAX_BYTES = MiB  # non-contiguous tensors need a 2x buffer: only for small ones


@dataclass
class Pending:
    """An issued operation: what to wait for, then how to check its result."""
    step: int
    desc: str
    waits: list = field(default_factory=list)  # Works and Futures
    check: Callable[[], None] = lambda: None
    kind: str = ""


class Collectives:
    """The ``_<kind>(step, nbytes, async_op)`` methods that ``Soak.issue`` calls. Mixed into
    ``Soak``, which provides ``rank``, ``n``, ``gloo``, ``rng``, ``mismatches``, ``context``,
    ``key``, ``input``, ``expect``, ``draw_dtype`` and ``draw_op``."""

    def _all_reduce(self, step: int, nbytes: int, async_op: bool) -> Pending:
        dtype = self.draw_dtype()
        op = self.draw_op(dtype)
        numel = nbytes // dtype.itemsize
        strided = nbytes <= STRIDED_MAX_BYTES and self.rng.random() < 0.15
        mine = self.input(step, self.rank, numel, dtype, op)
        if strided:  # every other element of a 2x buffer: the backend stages a contiguous copy
            base = self.input(step, self.rank, 2 * numel, dtype, op, salt=1)
            base[::2] = mine
            t = base[::2]
        else:
            t = mine.clone()
        work = dist.all_reduce(t, op=OPS[op], async_op=async_op)
        desc = f"dtype={dtype} op={op} numel={numel} strided={strided}"

        def check() -> None:
            self.expect(t, fold((self.input(step, r, numel, dtype, op) for r in range(self.n)), op, self.n))
            if strided:
                self.expect(base[1::2], self.input(step, self.rank, 2 * numel, dtype, op, salt=1)[1::2],
                            "gaps of the strided buffer")

        return Pending(step, desc, [work] if async_op else [], check)

    def _broadcast(self, step: int, nbytes: int, async_op: bool) -> Pending:
        dtype = self.draw_dtype()
        root = self.rng.randrange(self.n)
        numel = nbytes // dtype.itemsize
        t = self.input(step, self.rank, numel, dtype)  # non-roots start from other values
        work = dist.broadcast(t, root, async_op=async_op)
        desc = f"dtype={dtype} root={root} numel={numel}"
        return Pending(step, desc, [work] if async_op else [],
                       lambda: self.expect(t, self.input(step, root, numel, dtype)))

    def _reduce(self, step: int, nbytes: int, async_op: bool) -> Pending:
        dtype = self.draw_dtype()
        op = self.draw_op(dtype)
        root = self.rng.randrange(self.n)
        numel = nbytes // dtype.itemsize
        t = self.input(step, self.rank, numel, dtype, op)
        work = dist.reduce(t, root, op=OPS[op], async_op=async_op)
        desc = f"dtype={dtype} op={op} root={root} numel={numel}"

        def check() -> None:
            if self.rank == root:
                self.expect(t, fold((self.input(step, r, numel, dtype, op) for r in range(self.n)), op, self.n))
            else:  # non-roots keep their input (documented in tests/workers/collectives.py)
                self.expect(t, self.input(step, self.rank, numel, dtype, op), "non-root input")

        return Pending(step, desc, [work] if async_op else [], check)

    def _gathered(self, step: int, nbytes: int, async_op: bool, into_tensor: bool) -> Pending:
        dtype = self.draw_dtype()
        numel = nbytes // (dtype.itemsize * self.n)
        mine = self.input(step, self.rank, numel, dtype)
        if into_tensor:
            out = torch.empty(self.n * numel, dtype=dtype)
            work = dist.all_gather_into_tensor(out, mine, async_op=async_op)
            slots = list(out.view(self.n, numel))
        else:
            slots = [torch.empty(numel, dtype=dtype) for _ in range(self.n)]
            work = dist.all_gather(slots, mine, async_op=async_op)
        desc = f"dtype={dtype} numel={numel}"

        def check() -> None:
            for r, slot in enumerate(slots):
                self.expect(slot, self.input(step, r, numel, dtype), f"slot {r}")

        return Pending(step, desc, [work] if async_op else [], check)

    def _all_gather(self, step: int, nbytes: int, async_op: bool) -> Pending:
        return self._gathered(step, nbytes, async_op, into_tensor=False)

    def _all_gather_into_tensor(self, step: int, nbytes: int, async_op: bool) -> Pending:
        return self._gathered(step, nbytes, async_op, into_tensor=True)

    def _scattered(self, step: int, nbytes: int, async_op: bool, from_tensor: bool) -> Pending:
        dtype = self.draw_dtype()
        op = self.draw_op(dtype)
        numel = nbytes // (dtype.itemsize * self.n)
        mine = self.input(step, self.rank, self.n * numel, dtype, op)
        out = torch.empty(numel, dtype=dtype)
        if from_tensor:
            work = dist.reduce_scatter_tensor(out, mine, op=OPS[op], async_op=async_op)
        else:
            work = dist.reduce_scatter(out, list(mine.view(self.n, numel)), op=OPS[op], async_op=async_op)
        desc = f"dtype={dtype} op={op} numel={numel} per rank"
        lo, hi = self.rank * numel, (self.rank + 1) * numel

        def check() -> None:
            everyone = (self.input(step, r, self.n * numel, dtype, op)[lo:hi] for r in range(self.n))
            self.expect(out, fold(everyone, op, self.n))

        return Pending(step, desc, [work] if async_op else [], check)

    def _reduce_scatter(self, step: int, nbytes: int, async_op: bool) -> Pending:
        return self._scattered(step, nbytes, async_op, from_tensor=False)

    def _reduce_scatter_tensor(self, step: int, nbytes: int, async_op: bool) -> Pending:
        return self._scattered(step, nbytes, async_op, from_tensor=True)

    def _split_matrix(self, budget: int) -> list[list[int]]:
        """counts[i][j]: what rank i sends rank j; every rank sends and receives <= budget."""
        most = budget // self.n
        return [[self.rng.choice((0, self.rng.randint(0, most), most)) for _ in range(self.n)]
                for _ in range(self.n)]

    def _all_to_all_single(self, step: int, nbytes: int, async_op: bool) -> Pending:
        dtype = self.draw_dtype()
        cols = self.rng.choice((1, 3))
        rows_budget = nbytes // (dtype.itemsize * cols)
        even = self.rng.random() < 0.3
        if even:
            rows = rows_budget // self.n
            counts = [[rows] * self.n for _ in range(self.n)]
        else:
            counts = self._split_matrix(rows_budget)
        sent = [sum(row) for row in counts]
        received = sum(counts[i][self.rank] for i in range(self.n))
        mine = self.input(step, self.rank, sent[self.rank] * cols, dtype).view(-1, cols)
        out = torch.empty(received, cols, dtype=dtype)
        splits = {} if even else dict(output_split_sizes=[counts[i][self.rank] for i in range(self.n)],
                                      input_split_sizes=counts[self.rank])
        work = dist.all_to_all_single(out, mine, async_op=async_op, **splits)
        desc = f"dtype={dtype} cols={cols} even={even} rows={counts}"

        def check() -> None:
            offset = 0
            for i in range(self.n):
                start = sum(counts[i][: self.rank])
                theirs = self.input(step, i, sent[i] * cols, dtype).view(-1, cols)
                k = counts[i][self.rank]
                self.expect(out[offset:offset + k], theirs[start:start + k], f"rows from rank {i}")
                offset += k

        return Pending(step, desc, [work] if async_op else [], check)

    def _all_to_all(self, step: int, nbytes: int, async_op: bool) -> Pending:
        dtype = self.draw_dtype()
        counts = self._split_matrix(nbytes // dtype.itemsize)
        mine = self.input(step, self.rank, sum(counts[self.rank]), dtype)
        outs = [torch.empty(counts[i][self.rank], dtype=dtype) for i in range(self.n)]
        work = dist.all_to_all(outs, list(mine.split(counts[self.rank])), async_op=async_op)
        desc = f"dtype={dtype} counts={counts}"

        def check() -> None:
            for i in range(self.n):
                theirs = self.input(step, i, sum(counts[i]), dtype).split(counts[i])[self.rank]
                self.expect(outs[i], theirs, f"from rank {i}")

        return Pending(step, desc, [work] if async_op else [], check)

    def _gather(self, step: int, nbytes: int, async_op: bool) -> Pending:
        dtype = self.draw_dtype()
        root = self.rng.randrange(self.n)
        numel = nbytes // (dtype.itemsize * self.n)
        mine = self.input(step, self.rank, numel, dtype)
        slots = [torch.empty(numel, dtype=dtype) for _ in range(self.n)] if self.rank == root else None
        work = dist.gather(mine, slots, dst=root, async_op=async_op)
        desc = f"dtype={dtype} root={root} numel={numel}"

        def check() -> None:
            for r, slot in enumerate(slots or []):
                self.expect(slot, self.input(step, r, numel, dtype), f"slot {r}")

        return Pending(step, desc, [work] if async_op else [], check)

    def _scatter(self, step: int, nbytes: int, async_op: bool) -> Pending:
        dtype = self.draw_dtype()
        root = self.rng.randrange(self.n)
        numel = nbytes // (dtype.itemsize * self.n)
        parts = list(self.input(step, root, self.n * numel, dtype).view(self.n, numel)) if self.rank == root else None
        out = torch.empty(numel, dtype=dtype)
        work = dist.scatter(out, parts, src=root, async_op=async_op)
        desc = f"dtype={dtype} root={root} numel={numel}"
        lo = self.rank * numel
        return Pending(step, desc, [work] if async_op else [],
                       lambda: self.expect(out, self.input(step, root, self.n * numel, dtype)[lo:lo + numel]))

    def _barrier(self, step: int, nbytes: int, async_op: bool) -> Pending:
        work = dist.barrier(async_op=async_op)
        return Pending(step, "", [work] if async_op else [])

    def _send_recv(self, step: int, nbytes: int, async_op: bool) -> Pending:
        """One pair (src sends, dst receives, blocking calls unless async), or a shift: every
        rank sends to rank + shift and receives from rank - shift at once (isend / irecv)."""
        dtype = self.draw_dtype()
        tag = self.rng.randrange(1 << 16)
        numel = nbytes // dtype.itemsize
        if self.rng.random() < 0.5:
            src, dst = self.rng.sample(range(self.n), 2)
            to = dst if self.rank == src else None
            frm = src if self.rank == dst else None
            desc = f"pair {src}->{dst}"
        else:
            shift = self.rng.randrange(1, self.n)
            to, frm = (self.rank + shift) % self.n, (self.rank - shift) % self.n
            desc = f"shift {shift}"
        desc += f" dtype={dtype} tag={tag} numel={numel}"
        got = torch.empty(numel, dtype=dtype)
        mine = self.input(step, self.rank, numel, dtype) if to is not None else None
        waits = []
        if async_op or (to is not None and frm is not None):  # both ways at once: never blocking
            if to is not None:
                waits.append(dist.isend(mine, to, tag=tag))
            if frm is not None:
                waits.append(dist.irecv(got, frm, tag=tag))
        elif to is not None:
            dist.send(mine, to, tag=tag)
        elif frm is not None:
            dist.recv(got, frm, tag=tag)
        if not async_op:
            for w in waits:
                w.wait()
            waits = []

        def check() -> None:
            if frm is not None:
                self.expect(got, self.input(step, frm, numel, dtype), f"from rank {frm}")

        return Pending(step, desc, waits, check)

    def _compressed_all_reduce(self, step: int, nbytes: int, async_op: bool, name: Optional[str] = None,
                               dtype: Optional[torch.dtype] = None) -> Pending:
        """Native compressed all-reduce, checked against the fallback over gloo (documented to
        give the same bits) on the same inputs, residuals and randomness stream."""
        name = name or self.rng.choice(list(COMPRESSORS))
        dtype = dtype or self.draw_dtype(COMPRESSED_DTYPES)
        worker_ef, server_ef, average = (self.rng.random() < 0.7 for _ in range(3))
        numel = nbytes // dtype.itemsize
        g = torch.Generator().manual_seed(self.key(step, self.rank))
        x = torch.randn(numel, generator=g).to(dtype)
        wres = torch.randn(numel, generator=g) * 0.1 if worker_ef else None
        sres = torch.randn(server_residual_numel(numel, self.rank, self.n), generator=g) * 0.1 if server_ef else None
        originals = [None if t is None else t.clone() for t in (x, wres, sres)]
        future = compressed_all_reduce(x, COMPRESSORS[name](), wres, sres, average=average, stream=step)
        desc = f"{name} dtype={dtype} numel={numel} worker_ef={worker_ef} server_ef={server_ef} average={average}"
        if not async_op:
            future.wait()

        def check() -> None:
            rx, rw, rs = originals
            compressed_all_reduce(rx, COMPRESSORS[name](), rw, rs, group=self.gloo, average=average, stream=step).wait()
            self.expect(x, rx, "result vs the gloo fallback")
            for what, native, fallback in (("worker", wres, rw), ("server", sres, rs)):
                if native is not None:
                    self.expect(native, fallback, f"{what} residual vs the gloo fallback")
            hashes = torch.empty(self.n, dtype=torch.int64)
            dist.all_gather_into_tensor(hashes, torch.tensor([digest(x)]), group=self.gloo)
            if len(set(hashes.tolist())) > 1:
                self.mismatches.append(f"rank {self.rank} {self.context}: ranks hold different results "
                                       f"(hashes {hashes.tolist()})")

        return Pending(step, desc, [future] if async_op else [], check)
