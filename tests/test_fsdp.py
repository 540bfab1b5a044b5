"""Compressed gradients for FSDP2 and HSDP (ddlcomm.fsdp), on ddlcomm and gloo groups."""

from __future__ import annotations

import pytest
import torch

from harness import assert_all_ok, launch

from ddlcomm import compress, fsdp


@pytest.mark.parametrize("backend,ranks", [("ddlcomm", 4), ("gloo", 2)])
def test_compressed_reduce_scatter_loses_nothing(backend: str, ranks: int) -> None:
    assert_all_ok(launch("sharded", "reduce_scatter_math", ranks, timeout=120, args=(backend,)))


def _print_accuracy(results) -> None:
    for line in results[0].output.splitlines():
        if line.startswith("ACCURACY"):
            print(line)


def test_fsdp2_training_keeps_accuracy() -> None:
    results = launch("sharded", "training", 2, timeout=400)
    _print_accuracy(results)
    assert_all_ok(results)


def test_fsdp2_resume_is_bit_identical() -> None:
    assert_all_ok(launch("sharded", "resume", 2, timeout=180, args=("onebit",)))


def test_hsdp_replicas_agree_and_keep_accuracy() -> None:
    results = launch("sharded", "hsdp", 4, timeout=400)
    _print_accuracy(results)
    assert_all_ok(results)


def test_state_refuses_bad_options() -> None:
    with pytest.raises(TypeError, match="compressor"):
        fsdp.FSDPCompressionState("onebit")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="min_compression_bytes"):
        fsdp.FSDPCompressionState(compress.OneBit(), min_compression_bytes=-1)
    with pytest.raises(ValueError, match="fully_shard"):
        fsdp.compress_gradients(torch.nn.Linear(2, 2), compress.OneBit())
