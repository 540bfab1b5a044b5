"""Error-feedback conservation of the compressed all-reduce, checked without any kernel: run
on every rank by tests/test_conservation.py.

Whatever a compressor does, error feedback loses nothing. Each rank encodes y_r = x_r + w_old_r
and keeps w_new_r = y_r - decoded_r; the rank that reduces a chunk encodes z = mean_r(decoded_r)
+ s_old and keeps s_new = z - decoded(z), and that decoded value is the result. So on every
element, up to float32 rounding:

    out == mean_r(x_r + w_old_r - w_new_r) + s_old - s_new

(no server term for the sparse formats, which all-gather the rank payloads). The check reads
only the inputs and residuals before and after the call, so it holds the C++ implementation on
both groups to the law while sharing no code with it: a wrong chunk, a residual
not updated or updated at the wrong place, a server residual of the wrong rank, a payload
summed twice or dropped would all break it.

Tolerance, with u = 2^-24 (float32 unit roundoff) and n ranks: per rank, y = fl(x + w_old) and
w_new = fl(y - d) put d within u(|x| + |w_old| + |w_new|) of x + w_old - w_new; the float32 sum
of n decoded values in rank order adds at most (n - 1) u mean_r |d_r|; the factor fl(1/n) and
its multiply at most 2u mean_r |d_r|; z = fl(acc + s_old) and s_new = fl(z - out) at most
u (|out| + 2 |s_new|). With A = mean_r(|x_r| + |w_old_r| + |w_new_r|) the first-order bound
is u ((n + 2) A + |out| + 2 |s_new|); the test allows twice that (second-order terms), i.e.
2^-23 ((n + 2) A + |out| + 2 |s_new|) per element, about 1e-6 of the magnitudes involved.
The reference itself is summed in float64 (exact enough to be ignored).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from common import ddlcomm_stats, init, run
from ddlcomm import ProcessGroupDdlcomm, compressors
from ddlcomm.compressed import (compressed_all_reduce, engine_of, native_backend, server_chunks, server_residual_numel,
                                two_levels)
from ddlcomm.host_levels import host_levels

U = 2.0**-24  # float32 unit roundoff
# torch 2.13 renamed all_gather_into_tensor (and deprecated the old name).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

COMPRESSORS = {
    "onebit": lambda: compressors.OneBit(block_size=64),
    "onebit2": lambda: compressors.OneBit(block_size=64, two_scales=True),
    "ternary": lambda: compressors.Ternary(block_size=64),
    "ternary_stochastic": lambda: compressors.Ternary(block_size=64, stochastic=True, seed=3),
    "topk": lambda: compressors.TopK(ratio=0.05),
    "randomk": lambda: compressors.RandomK(ratio=0.05, seed=5),
    "fp16": compressors.FP16,
    "bf16": compressors.BF16,
}
SPARSE = {"top_k", "random_k"}
STOCHASTIC = ("ternary_stochastic", "randomk")
TWO_PIECES = ("ternary_stochastic", "bf16")  # checked on a vector of two pieces too


def own_chunks(numel: int, rank: int, n: int, hosts: list[list[int]] | None = None) -> list[tuple[int, int]]:
    """The positions rank `rank` reduces, from the documented split (not the package's helper):
    pieces of piece_elements, chunk i of a piece of length L is [L*i//n, L*(i+1)//n). Over
    `hosts` (each host's ranks, the hierarchical plan, docs/collectives.md): the same lengths,
    placed host-major within local rank: the chunks of local rank 0 on host 0, 1, ..., then of
    local rank 1 on every host, and so on."""
    step = ProcessGroupDdlcomm.piece_elements
    chunks = []
    for begin in range(0, numel, step):
        length = min(step, numel - begin)
        size = [length * (r + 1) // n - length * r // n for r in range(n)]
        order = list(range(n)) if hosts is None else [host[l] for l in range(len(hosts[0])) for host in hosts]
        at = begin + sum(size[r] for r in order[:order.index(rank)])
        chunks.append((at, at + size[rank]))
    return chunks


def sample_positions(numel: int, n: int, window: int, stride: int) -> torch.Tensor:
    """Positions to check on a long vector: every one within `window` of a chunk or piece
    boundary (where a wrong offset shows first), and every `stride`-th one elsewhere."""
    keep = torch.zeros(numel, dtype=torch.bool)
    keep[::stride] = True
    for rank in range(n):
        for begin, end in own_chunks(numel, rank, n):
            for edge in (begin, end):
                keep[max(0, edge - window):edge + window] = True
    return keep.nonzero().flatten()


@functools.lru_cache(maxsize=1)
def inputs(rank: int, numel: int, s_numel: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's x (of varied magnitudes: blocks of very different scales), worker and server
    residuals of the size a few steps of error feedback leave. Reused (cloned) by the calls."""
    g = torch.Generator().manual_seed(1000 * rank + numel)
    x = torch.randn(numel, generator=g) * torch.exp(1.5 * torch.randn(numel, generator=g))
    return x, torch.randn(numel, generator=g) * 0.3, torch.randn(s_numel, generator=g) * 0.3


def check_conservation(name: str, numel: int, group, gloo: dist.ProcessGroup, stream: int,
                       positions: torch.Tensor | None = None, hosts: list[list[int]] | None = None,
                       flat: bool = False) -> None:
    """One compressed all-reduce of `numel` elements, checked against the law at `positions`
    (default: every element). With `hosts`, the hierarchical plan: the law is the same (only the
    ranks that compress a shard touch their worker residual there; the exact sums inside a host
    add at most (ranks per host - 1) u mean|x|, within the tolerance's (n + 2) u A). `flat`: the
    call asks for one level (the flat plan, whatever the group's)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    comp = COMPRESSORS[name]()
    sparse = comp.format in SPARSE
    what = f"{name} x{numel} on {'ddlcomm' if native_backend(group) else 'gloo'}{' flat' if flat else ''}"
    if positions is None:
        positions = torch.arange(numel)

    mine = own_chunks(numel, rank, n, None if sparse or flat else hosts)
    if hosts is None or flat:
        assert mine == server_chunks(numel, rank, n), f"{what}: server_chunks disagrees with the documented split"
    assert mine == server_chunks(numel, rank, n, group, comp, flat), f"{what}: the group's plan is not the documented"
    s_numel = sum(end - begin for begin, end in mine)
    assert s_numel == server_residual_numel(numel, rank, n)
    x, w_old, s_old = inputs(rank, numel, s_numel)
    x0 = x[positions].double()
    x, w_new, s_new = x.clone(), w_old.clone(), s_old.clone()

    out = compressed_all_reduce(x, comp, w_new, s_new, group=group, stream=stream, flat=flat).wait()
    assert out.dtype == torch.float32 and out.shape == (numel,)
    for t in (out, w_new, s_new):  # a finite float32 sum of values below 1e6: all are finite
        assert bool(torch.isfinite(t.sum())), what
    if sparse:
        assert torch.equal(s_new, s_old), f"{what}: a sparse format touched the server residual"

    # Sum the worker terms over ranks in float64, and place every rank's server residuals at
    # their positions (each position is one rank's, so that sum only places them).
    wo, wn = w_old[positions].double(), w_new[positions].double()
    terms = torch.zeros(5, positions.numel(), dtype=torch.float64)
    terms[0] = x0 + wo - wn
    terms[1] = x0.abs() + wo.abs() + wn.abs()
    at = 0  # where the chunk [begin, end) starts in the server residual
    for begin, end in mine:
        lo, hi = torch.searchsorted(positions, torch.tensor([begin, end])).tolist()
        where = positions[lo:hi] - begin + at
        terms[2, lo:hi] = s_old[where].double()  # s_old, s_new, and the ranks covering the position
        terms[3, lo:hi] = s_new[where].double()
        terms[4, lo:hi] = 1
        at += end - begin
    dist.all_reduce(terms, group=gloo)
    assert torch.all(terms[4] == 1), f"{what}: the ranks' chunks do not partition the vector"
    mean, magnitude = terms[0] / n, terms[1] / n
    s_term = 0 if sparse else terms[2] - terms[3]
    s_abs = 0 if sparse else terms[3].abs()
    got = out[positions].double()
    expected = mean + s_term
    err = (got - expected).abs()
    tol = 2 * U * ((n + 2) * magnitude + got.abs() + 2 * s_abs)
    bad = (err > tol).nonzero().flatten()
    assert bad.numel() == 0, (
        f"{what}: conservation broken at {bad.numel()} of {positions.numel()} checked elements, first "
        f"{positions[bad[:5]].tolist()}: out {got[bad[:3]].tolist()}, mean(x + w_old - w_new) + s_old - s_new "
        f"{expected[bad[:3]].tolist()}, tolerance {tol[bad[:3]].tolist()}")

    # Every rank holds the same result (so the check above, made on each rank, holds for all).
    everyone = torch.empty(n * positions.numel())
    _all_gather_single(everyone, out[positions], group=gloo)
    assert all(torch.equal(row, out[positions]) for row in everyone.view(n, -1)), f"{what}: ranks disagree"


def conservation(gloo: dist.ProcessGroup) -> None:
    """Every compressor on a ddlcomm (native) and a gloo (fallback) group, sizes from smaller than
    the group to several reduce tiles per chunk; then a vector longer than one piece (the
    second one short), checked near every chunk and piece boundary and at a sample elsewhere."""
    for numel in (1, 6, 4099, 70_001):
        for group in (None, gloo):
            for stream, name in enumerate(COMPRESSORS):
                check_conservation(name, numel, group, gloo, stream)
    numel = ProcessGroupDdlcomm.piece_elements + 70_001
    positions = sample_positions(numel, dist.get_world_size(), window=4096, stride=61)
    for group in (None, gloo):
        for name in TWO_PIECES:
            check_conservation(name, numel, group, gloo, stream=7, positions=positions)


def ranks_draw_different_randomness(gloo: dist.ProcessGroup) -> None:
    """Every rank reduces the same input with zero residuals: the stochastic formats must draw
    different randomness on each rank (so their worker residuals differ), and chunks of the same
    values within a rank differently too, while a deterministic format gives every rank the same
    residual (the control that makes the comparison meaningful). A randomness stream that ignored
    the rank (or the chunk) would give equal residuals everywhere."""
    rank, n = dist.get_rank(), dist.get_world_size()
    chunk = 4096  # 4 equal chunks holding the same values
    base = torch.randn(chunk, generator=torch.Generator().manual_seed(1))
    for group in (None, gloo):
        where = "ddlcomm" if native_backend(group) else "gloo"
        for name in (*STOCHASTIC, "onebit", "fp16"):
            comp = COMPRESSORS[name]()
            x = base.repeat(n)
            w = torch.zeros(n * chunk)
            s = torch.zeros(server_residual_numel(n * chunk, rank, n))
            compressed_all_reduce(x, comp, w, s, group=group, stream=5).wait()
            everyone = torch.empty(n * n * chunk)
            _all_gather_single(everyone, w, group=gloo)
            everyone = everyone.view(n, n * chunk)
            same = [r for r in range(n) if r != rank and torch.equal(everyone[r], w)]
            chunks_same = [i for i in range(1, n) if torch.equal(w[i * chunk:(i + 1) * chunk], w[:chunk])]
            if name in STOCHASTIC:
                assert not same, f"{name} on {where}: rank {rank} drew the same randomness as ranks {same}"
                if comp.format != "random_k":  # random-k draws its indices over the whole vector
                    assert not chunks_same, f"{name} on {where}: chunks {chunks_same} drew chunk 0's randomness"
            else:
                assert len(same) == n - 1 and len(chunks_same) == n - 1, f"{name} on {where}: control differs"


def hierarchical() -> None:
    """Ranks 0-1 and 2-3 on two named hosts: every compressor's all-reduce on the ddlcomm group
    and on a gloo group (exact inside each host, compressed across; the same C++ on both, over
    the group's own transport or gloo's send and recv) keeps the law over the hierarchical plan, the sparse formats included (their
    selection made on each rank's shard of its host's sum); a call with flat=True (the adaptive
    hook's one-level option) keeps it over the flat plan, and both groups agree bitwise either way."""
    init()
    gloo = dist.new_group(backend="gloo")
    hosts = [[0, 1], [2, 3]]
    before = ddlcomm_stats()
    assert before["topology"] == "2 hosts x 2 ranks", before
    levels = host_levels(gloo)
    assert levels is not None and levels.topology == "2 hosts x 2 ranks", "the gloo group's hosts"
    assert dist.get_process_group_ranks(levels.host) == hosts[dist.get_rank() // 2]
    assert dist.get_process_group_ranks(levels.across) == [dist.get_rank() % 2, 2 + dist.get_rank() % 2]
    assert two_levels(None) and two_levels(gloo)
    for numel in (6, 4099, 70_001):
        for group in (None, gloo):
            for stream, name in enumerate(COMPRESSORS):
                check_conservation(name, numel, group, gloo, stream, hosts=hosts)
    numel = ProcessGroupDdlcomm.piece_elements + 70_001
    positions = sample_positions(numel, dist.get_world_size(), window=4096, stride=61)
    for group in (None, gloo):
        for name in TWO_PIECES:
            check_conservation(name, numel, group, gloo, stream=7, positions=positions, hosts=hosts)
    for group in (None, gloo):
        for stream, name in enumerate(COMPRESSORS):
            check_conservation(name, 4099, group, gloo, stream, flat=True)
    # The same C++ over either group's messages: the same bits, in either plan.
    gloo_before = engine_of(gloo).stats()["hierarchical_compressed_allreduces"]
    for flat in (False, True):
        for stream, name in enumerate(COMPRESSORS):
            comp, rank, numel = COMPRESSORS[name](), dist.get_rank(), 70_001
            x, w, s = inputs(rank, numel, server_residual_numel(numel, rank, 4))
            results = []
            for group in (None, gloo):
                out, w_new, s_new = x.clone(), w.clone(), s.clone()
                compressed_all_reduce(out, comp, w_new, s_new, group=group, stream=stream, flat=flat).wait()
                results.append((out, w_new, s_new))
            for what, native, fallback in zip(("result", "worker residual", "server residual"), *results):
                assert torch.equal(native, fallback), f"{name}: the gloo group's {what} differs from the native one"
    # Only the ddlcomm group's calls without flat take two levels: 3 sizes, two pieces, compared.
    took = ddlcomm_stats()["hierarchical_compressed_allreduces"] - before["hierarchical_compressed_allreduces"]
    assert took == 4 * len(COMPRESSORS) + len(TWO_PIECES), took
    took = engine_of(gloo).stats()["hierarchical_compressed_allreduces"] - gloo_before
    assert took == len(COMPRESSORS), f"the gloo group's compared calls took two levels {took} times"


def conservation_and_randomness() -> None:
    """Both checks, in one start of the ranks (most of a launch's time is importing torch)."""
    init()
    gloo = dist.new_group(backend="gloo")
    conservation(gloo)
    ranks_draw_different_randomness(gloo)


if __name__ == "__main__":
    run()
