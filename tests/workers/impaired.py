"""Collectives over an emulated lossy, slow or broken network, run on every rank (each in its
own network namespace) by tests/test_slownet_ddlcomm.py."""

from __future__ import annotations

import json
import time

import torch
import torch.distributed as dist

from common import assert_equal, ddlcomm_stats, init, make_input, reference, run
from ddlcomm import ProcessGroupDdlcomm, compressors
from ddlcomm.compressed import compressed_all_reduce


def compressed_reference(inputs: list[torch.Tensor], comp: compressors.Compressor, stream: int) -> torch.Tensor:
    """A quantizing compressed all-reduce (average, no residuals) computed locally from every
    rank's input: chunk j is the sum, in rank order, of every rank's encoded chunk j, averaged,
    encoded again by rank j (see ddlcomm.compressed) and decoded."""
    n, numel = len(inputs), inputs[0].numel()
    bounds = [numel * i // n for i in range(n + 1)]  # ring::Chunks of one piece, written out as the oracle
    out = torch.empty(numel)
    for j in range(n):
        acc = torch.zeros(bounds[j + 1] - bounds[j])
        for r in range(n):
            stream_rj = ProcessGroupDdlcomm.encode_stream(stream, r, 0, j, n)
            comp.decode_accumulate(comp.encode(inputs[r][bounds[j] : bounds[j + 1]], None, stream=stream_rj), acc)
        acc.mul_(1.0 / n)
        reduced = comp.encode(acc, None, stream=ProcessGroupDdlcomm.encode_stream(stream, j, 1, j, n))
        comp.decode(reduced, out=out[bounds[j] : bounds[j + 1]])
    return out


def mixed() -> None:
    """All-reduces of several sizes up to 4 MiB, broadcasts, an all-gather and a compressed
    all-reduce: every result equals the one computed locally from every rank's input."""
    rank, n = init(timeout_s=60)
    assert ddlcomm_stats()["topology"] == f"{n} hosts x 1 rank", ddlcomm_stats()  # a namespace is a host
    start = time.monotonic()
    for numel in (1, 1000, 16_385, 300_007, 1 << 20):  # 1 << 20 float32: 4 MiB
        inputs = [make_input(r, numel, torch.float32) for r in range(n)]
        t = inputs[rank].clone()
        dist.all_reduce(t)
        assert_equal(t, reference(inputs, "SUM"), f"all_reduce x{numel}")
    for root, numel in ((0, 1001), (n - 1, 500_000)):  # tree and chain broadcast
        expected = make_input(root, numel, torch.float32, salt=1)
        t = expected.clone() if rank == root else torch.zeros(numel)
        dist.broadcast(t, root)
        assert_equal(t, expected, f"broadcast root {root} x{numel}")
    inputs = [make_input(r, 100_000, torch.int64, salt=2) for r in range(n)]
    gathered = [torch.empty_like(inputs[rank]) for _ in range(n)]
    dist.all_gather(gathered, inputs[rank])
    for r in range(n):
        assert_equal(gathered[r], inputs[r], f"all_gather part of rank {r}")
    comp = compressors.Ternary(block_size=64)
    inputs = [torch.randn(300_000, generator=torch.Generator().manual_seed(r)) for r in range(n)]
    out = compressed_all_reduce(inputs[rank].clone(), comp, stream=7).wait()
    assert_equal(out, compressed_reference(inputs, comp, stream=7), "compressed all-reduce (ternary)")
    print(f"rank {rank}: all collectives exact in {time.monotonic() - start:.2f} s", flush=True)


def hosts(shared_memory_peers: str, topology: str) -> None:
    """Under the default transport: as many shared-memory peers as expected (none where each
    network namespace is a host; every other rank where DDLCOMM_HOST_ID names one host; the
    other rank of its namespace with two in each), the topology, and an all-reduce equal to the
    one computed locally (hierarchical over several hosts with several ranks each)."""
    rank, n = init(timeout_s=60)
    stats = ddlcomm_stats()
    assert stats["shared_memory_peers"] == int(shared_memory_peers), stats
    assert stats["topology"] == topology, stats
    inputs = [make_input(r, 300_007, torch.float32) for r in range(n)]
    t = inputs[rank].clone()
    dist.all_reduce(t)
    assert_equal(t, reference(inputs, "SUM"), "all_reduce")
    hierarchical = ddlcomm_stats()["hierarchical_allreduces"] - stats["hierarchical_allreduces"]
    assert hierarchical == (0 < int(shared_memory_peers) < n - 1), (stats, ddlcomm_stats())
    print(f"rank {rank}: {stats['shared_memory_peers']} shared-memory peers", flush=True)


def link_down(timeout: str, numel: str) -> None:
    """All-reduce `numel` elements until the test cuts a link; report when (CLOCK_MONOTONIC) and
    how this rank failed."""
    _, n = init(timeout_s=float(timeout))
    t = torch.ones(int(numel))
    dist.all_reduce(t)
    assert torch.all(t == n)
    stats = ddlcomm_stats()
    print(f"READY {json.dumps([stats['topology'], stats['hierarchical_allreduces']])}", flush=True)
    try:
        while True:
            began = time.monotonic()
            dist.all_reduce(torch.ones(int(numel)))
    except dist.DistBackendError as e:
        failed = time.monotonic()
        report = {"failed_at": failed, "in_call": failed - began, "error": str(e)}
        print("FAILED " + json.dumps(report), flush=True)


if __name__ == "__main__":
    run()
