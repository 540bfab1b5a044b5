"""Shared set-up for worker processes: process groups and deterministic inputs."""

from __future__ import annotations

import functools
import gc
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

import ddlcomm  # noqa: F401  (registers the backend)

ALL_DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.uint8,
    torch.int32,
    torch.int64,
    torch.bool,
]
FLOAT_DTYPES = {torch.float32, torch.float64, torch.float16, torch.bfloat16}
OPS = {
    "SUM": dist.ReduceOp.SUM,
    "AVG": dist.ReduceOp.AVG,
    "MIN": dist.ReduceOp.MIN,
    "MAX": dist.ReduceOp.MAX,
    "PRODUCT": dist.ReduceOp.PRODUCT,
    "BAND": dist.ReduceOp.BAND,
    "BOR": dist.ReduceOp.BOR,
    "BXOR": dist.ReduceOp.BXOR,
}


def ddlcomm_stats(group=None) -> dict:
    """The ddlcomm group's counters (ProcessGroupDdlcomm.stats(): all-reduces per algorithm,
    established connections per peer, bytes on its sockets), after everything issued before."""
    return (group or dist.group.WORLD)._get_backend(torch.device("cpu")).stats()


def init(backend: str = "ddlcomm", timeout_s: float = 60.0) -> tuple[int, int]:
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


def op_valid(op: str, dtype: torch.dtype) -> bool:
    if op == "AVG":
        return dtype in FLOAT_DTYPES
    if op in ("BAND", "BOR", "BXOR"):
        return dtype not in FLOAT_DTYPES
    return True


def make_input(rank: int, numel: int, dtype: torch.dtype, op: str = "SUM", salt: int = 0) -> torch.Tensor:
    """Small integers, so every reduction is exact in every dtype and results can be compared bitwise."""
    g = torch.Generator().manual_seed(1000 * rank + 17 * numel + salt)
    if dtype == torch.bool:
        return torch.randint(0, 2, (numel,), generator=g).bool()
    if op == "PRODUCT":
        values = torch.randint(1, 3, (numel,), generator=g)  # 1 or 2: a product of 4 ranks stays <= 16
        if dtype != torch.uint8:
            values = values * (1 - 2 * torch.randint(0, 2, (numel,), generator=g))
        return values.to(dtype)
    low = 0 if dtype == torch.uint8 else -4
    return torch.randint(low, 5, (numel,), generator=g).to(dtype)


def reference(inputs: list[torch.Tensor], op: str) -> torch.Tensor:
    """The reduction computed directly from every rank's input."""
    dtype = inputs[0].dtype
    stacked = torch.stack(inputs)
    if dtype == torch.bool:
        if op in ("SUM", "MAX", "BOR"):
            return stacked.any(0)
        if op in ("PRODUCT", "MIN", "BAND"):
            return stacked.all(0)
        return functools.reduce(torch.bitwise_xor, inputs)
    if op == "SUM":
        return stacked.sum(0).to(dtype)
    if op == "AVG":
        return stacked.sum(0).to(dtype) / len(inputs)
    if op == "PRODUCT":
        return stacked.prod(0).to(dtype)
    if op == "MIN":
        return stacked.amin(0)
    if op == "MAX":
        return stacked.amax(0)
    fn = {"BAND": torch.bitwise_and, "BOR": torch.bitwise_or, "BXOR": torch.bitwise_xor}[op]
    return functools.reduce(fn, inputs)


def assert_equal(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Bitwise equality; the message shows the values at the first mismatched positions."""
    if actual.dtype != expected.dtype or actual.shape != expected.shape:
        raise AssertionError(f"{what}: got {actual.dtype} {tuple(actual.shape)}, "
                             f"expected {expected.dtype} {tuple(expected.shape)}")
    if torch.equal(actual, expected):
        return
    a, e = actual.flatten(), expected.flatten()
    bad = (a != e).nonzero().flatten()
    shown = bad[:5].tolist()
    raise AssertionError(f"{what}: {bad.numel()} of {a.numel()} elements differ; at flat index {shown} got "
                         f"{a[shown].tolist()} expected {e[shown].tolist()}")


def check_rank_sum(numel: int, what: str, group=None) -> None:
    """all_reduce of every rank's ``rank + 1`` in ``numel`` float32 elements on ``group``: each
    element must be ``n (n + 1) / 2``."""
    n = dist.get_world_size(group)
    x = torch.full((numel,), float(dist.get_rank(group) + 1))
    dist.all_reduce(x, group=group)
    assert_equal(x, torch.full_like(x, n * (n + 1) / 2), what)


def rss_bytes() -> int:
    """The resident set size of this process."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run() -> None:
    """Runs the scenario the command line names (a function of the worker module run as
    __main__, as tests/harness.py's ``launch`` passes it) with the arguments after it."""
    name = sys.argv[1]
    getattr(sys.modules["__main__"], name)(*sys.argv[2:])
    # Models in reference cycles (DDP's reducer, FSDP2's hooks) hold their process groups: free
    # them now, not during interpreter finalization, where a gloo group's worker threads
    # releasing tensors abort the process (SIGABRT, "terminate called without an active
    # exception", once in CI on a gloo reference rank; pytorch/pytorch#179291).
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()
    print(f"rank {os.environ.get('RANK')} scenario {name} OK", flush=True)
