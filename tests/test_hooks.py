"""Compressed all-reduce and the DDP hooks: bitwise agreement (every path, across
ranks), non-finite gradients, checkpointing and no_sync. Training quality: test_convergence.py."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from ddlcomm import _C, compressed, compressors, hooks
from harness import assert_all_ok, launch, named_hosts
from workers import collective_paths, compression


@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_every_path_agrees_bitwise(transport: str) -> None:
    # The ddlcomm group and the gloo group (its engine's messages through shared memory under
    # auto, over TCP and gloo's send and recv under tcp), and the collectives path (CUDA
    # tensors') over gloo's collectives; test_soak runs compressed all-reduces over every
    # transport. Two threads per rank, so that the largest vector's chunks are split across threads.
    assert_all_ok(launch(collective_paths.paths_agree, 4, timeout=180,
                         env={"DDLCOMM_NUM_THREADS": "2", "DDLCOMM_TRANSPORT": transport}))


@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_engine_of_a_gloo_group_takes_shared_memory_within_one_host(transport: str) -> None:
    assert_all_ok(launch(collective_paths.engine_transport, 4, timeout=120, rank_env=named_hosts(),
                         env={"DDLCOMM_TRANSPORT": transport}))


def test_every_path_agrees_bitwise_over_hosts() -> None:
    assert_all_ok(launch(collective_paths.hosts_agree, 4, timeout=240, rank_env=named_hosts(),
                         env={"DDLCOMM_ALLREDUCE_ALGO": "hierarchical"}))


def test_every_path_agrees_bitwise_in_half_precision_and_on_strided_tensors() -> None:
    assert_all_ok(launch(collective_paths.dtypes_agree, 3, timeout=180))


def test_compressed_all_reduce_is_the_plan_bitwise() -> None:
    assert_all_ok(launch(collective_paths.all_reduce_is_the_plan, 3, timeout=120))


def test_collectives_path_over_a_ddlcomm_group_agrees_bitwise() -> None:
    assert_all_ok(launch(collective_paths.over_ddlcomm_agrees, 3, timeout=120))


def test_every_path_agrees_bitwise_over_pieces() -> None:
    assert_all_ok(launch(collective_paths.pieces_agree, 4, timeout=240))


def test_hook_on_ddp_own_gloo_group_with_unused_parameters() -> None:
    assert_all_ok(launch(compression.hook_on_ddp_own_gloo_group, 2, timeout=120))


def test_state_versions() -> None:
    """A state of another layout version is refused, saying who wrote it, and the state is left
    as it was. Version 3 round trips: tests/test_resume.py."""
    old = {"version": 2, "iter": 7, "worker_residuals": {0: torch.ones(5)}, "stats": {"compressed_buckets": 3}}
    state = hooks.CompressionState(process_group=None)
    with pytest.raises(ValueError, match="development build before 0.1.0"):
        state.load_state_dict(old)
    with pytest.raises(ValueError, match="a newer ddlcomm"):
        state.load_state_dict({**old, "version": 99})
    assert state.iter == 0 and state.stats.compressed_buckets == 0


def test_non_finite_gradients_do_not_poison_residuals() -> None:
    assert_all_ok(launch(compression.non_finite, 4, timeout=180))


@pytest.mark.parametrize("ranks", [2, 4])
def test_direction_mode_native_fallback_and_replicas_agree(ranks: int) -> None:
    assert_all_ok(launch(compression.direction_mode, ranks, timeout=300))


def test_direction_mode_over_two_hosts() -> None:
    """2 hosts x 2 ranks, the hierarchy forced: the hooks over the gloo group take two levels
    too (exact inside a host)."""
    assert_all_ok(launch(compression.direction_mode, 4, timeout=300, rank_env=named_hosts(),
                         env={"DDLCOMM_ALLREDUCE_ALGO": "hierarchical"}))


def test_hook_mechanics() -> None:
    assert_all_ok(launch(compression.hook_mechanics, 2, timeout=240))


def test_warmup_ends_exactly_at_start_compress_iter() -> None:
    assert_all_ok(launch(compression.warmup_boundary, 2, timeout=120))


def test_uncompressed_buckets_are_logged_once() -> None:
    assert_all_ok(launch(compression.uncompressed_is_logged_once, 2, timeout=120))


@pytest.mark.parametrize("options, error, words", [
    ({"compressor": compressors.OneBit(), "momentum": 0.9}, ValueError, "sparse compressors"),
    ({"compressor": compressors.FP16(), "momentum": 0.9}, ValueError, "sparse compressors"),
    ({"compressor": "onebit"}, TypeError, "ddlcomm.compressors compressor"),
    ({"min_compression_bytes": -1}, ValueError, "min_compression_bytes"),
    ({"clip_norm": 0.0}, ValueError, "clip_norm"),
    ({"compressor": compressors.FP16(), "clip_norm": 1.0}, ValueError, "clip_grad_norm_ between backward"),
    ({"model": "net"}, TypeError, "torch.nn.Module"),
    ({"start_compress_iter": 1}, ValueError, "rebuilds its buckets"),
])
def test_state_refuses_options_it_would_ignore_or_misuse(options: dict, error: type, words: str) -> None:
    with pytest.raises(error, match=words):
        hooks.CompressionState(**options)


def test_native_backend_is_found_under_the_debug_wrapper() -> None:
    assert_all_ok(launch(collective_paths.debug_wrapper, 2, timeout=120, env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}))


@pytest.fixture
def one_rank() -> Iterator[None]:
    """A world of one gloo rank in this process: the hooks compress as on many ranks (over gloo's
    send and recv) without starting any."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("call, error, words", [
    (lambda: compressed.all_reduce_over_collectives(torch.ones(8, dtype=torch.int32), compressors.OneBit(), None,
                                                    None, None, True, 0, False, False), TypeError, "torch.int32"),
    (lambda: compressed.all_reduce_over_collectives(torch.ones(8), compressors.OneBit(), torch.zeros(7), None, None,
                                                    True, 0, False, False), ValueError, "8 elements, got 7"),
    (lambda: compressed.all_reduce_over_collectives(torch.ones(8), compressors.OneBit(), None,
                                                    torch.zeros(8, dtype=torch.float16), None, True, 0, False, False),
     TypeError, "server residual must be torch.float32"),
    (lambda: compressed.compressed_reduce_scatter(torch.empty(3), torch.ones(4), compressors.OneBit(), None,
                                                  dist.group.WORLD, True, 0, False),
     ValueError, "input of 4 elements for an output of 3 on 1 ranks"),
    (lambda: compressed.compressed_reduce_scatter(torch.empty(4), torch.ones(4, dtype=torch.float16),
                                                  compressors.OneBit(), None, dist.group.WORLD, True, 0, False),
     TypeError, "input torch.float16 and output torch.float32 differ"),
])
def test_the_collectives_path_refuses_bad_arguments(one_rank: None, call, error: type, words: str) -> None:
    with pytest.raises(error, match=words):
        call()


def test_a_route_is_kept_per_group_device_compressor_and_level(one_rank: None) -> None:
    """The hook starts a kept route per bucket: the same object for the same group, device,
    compressor and level, another for any of them changed; a route with neither a group's
    backends nor an engine is refused."""
    x = torch.ones(8)
    route = compressed.route_of(x, compressors.OneBit())
    assert compressed.route_of(torch.zeros(3), compressors.OneBit(), dist.group.WORLD) is route
    assert compressed.route_of(x, compressors.OneBit(block_size=64)) is not route
    assert compressed.route_of(x, compressors.OneBit(), flat=True) is not route
    assert compressed.route_of(x, compressors.OneBit(), dist.new_group([0], backend="gloo")) is not route
    assert route.start(x, None, None, True, 0).get_future().wait()[0].data_ptr() == x.data_ptr()
    with pytest.raises(ValueError, match="needs a group's backends or an engine"):
        _C.CompressedAllreduce(compressors.OneBit().config)


class _Bucket:
    """The part of dist.GradBucket the hook reads: an iteration's only bucket, with no
    parameters to map (the hook keys its memory by the bucket's index)."""

    def __init__(self, buffer: torch.Tensor) -> None:
        self._buffer = buffer

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def parameters(self) -> list[torch.nn.Parameter]:
        return []

    def index(self) -> int:
        return 0

    def is_last(self) -> bool:
        return True


def test_dgc_momentum_restarts_where_top_k_sent(one_rank: None) -> None:
    """DGC's momentum factor masking (CompressionState(momentum=) with top-k): an entry sent in
    one call (its worker residual is zero afterwards) starts its momentum afresh in the next;
    the others keep accumulating. After two calls the momentum is g2 where call 1 sent and
    momentum * g1 + g2 elsewhere."""
    momentum = 0.9
    state = hooks.CompressionState(compressor=compressors.TopK(ratio=0.25), momentum=momentum,
                                   min_compression_bytes=0, start_compress_iter=2)
    state.iter = state.start_compress_iter
    generator = torch.Generator().manual_seed(0)
    g1, g2 = torch.randn(64, generator=generator), torch.randn(64, generator=generator)
    hooks.compressed_hook(state, _Bucket(g1.clone())).wait()
    (worker,) = state.memory.worker_residuals.values()
    sent = worker == 0
    assert 0 < int(sent.sum()) < sent.numel(), "top-k sent none or all of the entries: nothing to tell apart"
    hooks.compressed_hook(state, _Bucket(g2.clone())).wait()
    assert state.stats.compressed_buckets == 2
    (accumulated,) = state.memory.momenta.values()
    torch.testing.assert_close(accumulated, torch.where(sent, g2, momentum * g1 + g2))


@pytest.mark.parametrize("short", [0, 1], ids=["exactly", "one_float_less"])
def test_min_compression_bytes_is_the_smallest_bucket_compressed(one_rank: None, short: int) -> None:
    """A bucket of exactly min_compression_bytes is compressed; one a float32 smaller goes as a
    plain all-reduce ("buckets smaller than min_compression_bytes")."""
    floats = 256
    state = hooks.CompressionState(compressor=compressors.OneBit(), min_compression_bytes=floats * 4,
                                   start_compress_iter=2)
    state.iter = state.start_compress_iter
    hooks.compressed_hook(state, _Bucket(torch.randn(floats - short))).wait()
    counts = (state.stats.compressed_buckets, state.stats.uncompressed_buckets)
    assert counts == ((1, 0) if short == 0 else (0, 1)), counts


def test_rank_and_world_are_the_state_groups(one_rank: None) -> None:
    """The hook and its checkpoint take the rank and world size from the state, of its process
    group or the world's without one: state_dict() saves them and a pickle keeps them to check."""
    for group in (None, dist.new_group([0])):
        state = hooks.CompressionState(process_group=group)
        assert state.rank_and_world() == (0, 1)
        saved = state.state_dict()
        assert (saved["rank"], saved["world_size"]) == state.rank_and_world()
        assert state.checkpoint.pickled(state).saved_world == state.rank_and_world()


def test_the_default_compressor_is_ternary() -> None:
    """Without compressor= (the trainers' callbacks pass None through) the hook takes the one
    compressor that kept accuracy with SGD and Adam on every recipe (docs/results/recipes.md)."""
    assert type(hooks.CompressionState().compressor) is compressors.Ternary


@pytest.mark.parametrize("compressor, optimizer, warned", [
    (compressors.OneBit(), "AdamW", True), (compressors.TopK(ratio=0.01), "Adam", True),
    (compressors.RandomK(ratio=0.1), "SGD", True), (compressors.Ternary(), "AdamW", False),
    (compressors.OneBit(), "SGD", False), (compressors.TopK(ratio=0.01), "SGD", True),
])
def test_pairs_that_lost_accuracy_say_so(caplog: pytest.LogCaptureFixture, compressor: compressors.Compressor,
                                         optimizer: str, warned: bool) -> None:
    """1-bit and top-k with Adam or AdamW, top-k with SGD (on the transformer of
    docs/results/compressors.md), and random-k with any optimizer, lost accuracy where ternary
    kept it: the state says so once, when it gets the optimizer; the pairs that kept it say
    nothing."""
    from ddlcomm import optim

    opt = getattr(optim, optimizer)(torch.nn.Linear(4, 4).parameters(), lr=0.1)
    with caplog.at_level(logging.WARNING, logger="ddlcomm.hooks"):
        hooks.CompressionState(compressor=compressor, optimizer=opt)
    assert ("consider Ternary()" in caplog.text) is warned, caplog.text


def test_dgc_momentum_says_it_lost_accuracy(caplog: pytest.LogCaptureFixture) -> None:
    """DGC's momentum= lost accuracy on both SGD recipes (docs/results/recipes.md, "top-k 1% DGC"):
    said at construction, with the better choice."""
    with caplog.at_level(logging.WARNING, logger="ddlcomm.hooks"):
        hooks.CompressionState(compressor=compressors.TopK(ratio=0.01), momentum=0.9)
    assert "optimizer=ddlcomm.optim.SGD" in caplog.text and "recipes.md" in caplog.text, caplog.text
