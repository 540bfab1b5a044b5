"""The compressed all-reduce against references that share no code with it: error-feedback
conservation on every element (tests/workers/conservation.py), and randomness streams that
differ for every rank, chunk, phase and piece, so that no two encodes of one call draw the
same random numbers (every adapter takes them from encode_stream: a stream that ignored the
rank would make them agree with each other and still be wrong)."""

from __future__ import annotations

import itertools

import torch

from ddlcomm import ProcessGroupDdlcomm
from ddlcomm.compressors import RandomK, Ternary
from harness import assert_all_ok, launch, named_hosts
from workers import conservation


def test_conservation_and_per_rank_randomness_on_ddlcomm_and_gloo_groups() -> None:
    assert_all_ok(launch(conservation.conservation_and_randomness, 4, timeout=180))


def test_conservation_over_two_hosts_of_two_ranks() -> None:
    """The hierarchical compressed all-reduce (exact inside a host, compressed across), forced
    for the gloo group (under auto only ddlcomm and nccl groups take it)."""
    assert_all_ok(launch(conservation.hierarchical, 4, timeout=180, rank_env=named_hosts(),
                         env={"DDLCOMM_ALLREDUCE_ALGO": "hierarchical"}))


def test_encode_stream_is_distinct_for_every_rank_chunk_phase_piece() -> None:
    encode_stream = ProcessGroupDdlcomm.encode_stream  # (call_stream, rank, phase, chunk, size, piece=0)
    assert encode_stream(5, 1, 0, 2, 4) == encode_stream(5, 1, 0, 2, 4, 0)
    for size in (1, 2, 3, 4, 8):
        grid = list(itertools.product((0, 1, 2, 7, 10**9), range(size), (0, 1), range(size), (0, 1, 2, 5)))
        streams = {encode_stream(call, rank, phase, chunk, size, piece) for call, rank, phase, chunk, piece in grid}
        distinct = len(streams)
        assert distinct == len(grid), f"{len(grid) - distinct} collisions among {len(grid)} encodes of size {size}"
        assert all(0 <= s < 2**64 for s in streams)


def test_stochastic_payloads_differ_between_ranks_chunks_phases_and_segments() -> None:
    """The same input encoded with the stream of each (rank, phase, chunk, piece) of a 4-rank
    call: stochastic ternary and random-k payloads all differ."""
    encode_stream = ProcessGroupDdlcomm.encode_stream
    n = 4
    x = torch.randn(2048, generator=torch.Generator().manual_seed(2))
    for compressor in (Ternary(block_size=64, stochastic=True, seed=3), RandomK(ratio=0.05, seed=5)):
        grid = list(itertools.product(range(n), (0, 1), range(n), (0, 1)))
        payloads = {bytes(compressor.encode(x, stream=encode_stream(9, rank, phase, chunk, n, piece)).tolist())
                    for rank, phase, chunk, piece in grid}
        distinct = len(payloads)
        assert distinct == len(grid), f"{compressor!r}: {len(grid) - distinct} repeated payloads"
