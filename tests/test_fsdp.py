"""Compressed gradients for FSDP2 and HSDP (ddlcomm.fsdp), on ddlcomm and gloo groups."""

from __future__ import annotations

import logging
from typing import Optional

import pytest
import torch

from harness import assert_all_ok, launch, named_hosts
from workers import collective_paths, convergence, sharded

from ddlcomm import compressors, fsdp


@pytest.mark.parametrize("backend,ranks", [("ddlcomm", 4), ("gloo", 2)])
def test_compressed_reduce_scatter_loses_nothing(backend: str, ranks: int) -> None:
    assert_all_ok(launch(sharded.reduce_scatter_math, ranks, timeout=120, args=(backend,)))


@pytest.mark.parametrize("backend", ["ddlcomm", "gloo"])
def test_compressed_reduce_scatter_over_two_hosts_of_two_ranks(backend: str) -> None:
    """Exact inside each host, compressed across (on the ddlcomm group from its topology, on gloo
    where the hierarchy is forced): still nothing lost, the residuals where the plan keeps them."""
    env = {"DDLCOMM_ALLREDUCE_ALGO": "hierarchical"} if backend == "gloo" else {}
    assert_all_ok(launch(sharded.reduce_scatter_math, 4, timeout=120, args=(backend, "2x2"), rank_env=named_hosts(),
                         env=env))


def _print_accuracy(results) -> None:
    for line in results[0].output.splitlines():
        if line.startswith("ACCURACY"):
            print(line)


def test_fsdp2_keeps_accuracy_on_the_convergence_task() -> None:
    """The convergence benchmark's MLP (2 ranks of 64, 300 steps, SGD momentum 0.9 at lr 0.4
    and AdamW at 3e-3: the rates best for plain all-reduce), seeds 0 and 1. The configurations
    docs/fsdp.md recommends (1-bit with 8-bit all-gathers and SGD's momentum in the
    communication; 1-bit and ternary with AdamW) must stay within 1.5 points of FSDP2 (more
    than three standard deviations of the difference of two 2-seed means,
    tests/test_convergence.py). That the task can tell is shown there, on the same task and
    seeds: 1-bit on gradients with SGD's momentum reaches about 10% (here too: 17% and 81%,
    measured; not rerun, to save CI time)."""
    import json
    import statistics

    checked = {"sgd": ("1-bit + 8-bit all-gather",), "adamw": ("1-bit", "ternary")}
    runs = [f"{opt}:{name}" for opt, names in checked.items() for name in ("all-reduce", *names)]
    results = launch(convergence.quality, 2, timeout=600, args=(";".join(runs), "0,1", "fsdp"))
    assert_all_ok(results)
    line = next(l for l in results[0].output.splitlines() if l.startswith("QUALITY "))
    acc = {opt: {name: statistics.fmean(v) for name, v in d.items()}
           for opt, d in json.loads(line[len("QUALITY "):]).items()}
    print(acc)
    for opt, names in checked.items():
        assert acc[opt]["all-reduce"] > 95.0, acc
        for name in names:
            assert acc[opt][name] >= acc[opt]["all-reduce"] - 1.5, (opt, name, acc)


def test_ddlcomm_and_gloo_groups_train_alike() -> None:
    assert_all_ok(launch(sharded.backends_agree, 2, timeout=180))


def test_the_state_reduce_scatters_alike_on_ddlcomm_and_gloo_groups() -> None:
    assert_all_ok(launch(sharded.state_reduce_scatters_alike, 3, timeout=240))


@pytest.mark.parametrize("layered", [False, True])
def test_compressed_reduce_scatter_is_the_plan_bitwise(layered: bool) -> None:
    """On a ddlcomm and a gloo group: flat on 3 ranks, the plan's bits computed in Python;
    over 2 named hosts x 2 ranks, the same bits on both groups."""
    if layered:
        results = launch(collective_paths.reduce_scatter_agrees, 4, timeout=240, args=("hosts",),
                         rank_env=named_hosts(),
                         env={"DDLCOMM_ALLREDUCE_ALGO": "hierarchical"})
    else:
        results = launch(collective_paths.reduce_scatter_agrees, 3, timeout=240)
    assert_all_ok(results)


def test_fsdp2_resume_is_bit_identical() -> None:
    assert_all_ok(launch(sharded.resume, 2, timeout=180, args=("onebit",)))


def test_hsdp_replicas_agree_and_keep_accuracy() -> None:
    results = launch(sharded.hsdp, 4, timeout=400)
    _print_accuracy(results)
    assert_all_ok(results)


@pytest.mark.parametrize("backend,ranks", [("ddlcomm", 4), ("gloo", 2)])
def test_quantized_all_gather(backend: str, ranks: int) -> None:
    results = launch(sharded.quantized_all_gather, ranks, timeout=300, args=(backend,))
    _print_accuracy(results)
    assert_all_ok(results)


def test_state_refuses_bad_options() -> None:
    with pytest.raises(TypeError, match="compressor"):
        fsdp.FSDPCompressionState("onebit")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="min_compression_bytes"):
        fsdp.FSDPCompressionState(compressors.OneBit(), min_compression_bytes=-1)
    with pytest.raises(ValueError, match="fully_shard"):
        fsdp.compress_gradients(torch.nn.Linear(2, 2), compressors.OneBit())
    with pytest.raises(ValueError, match="fully_shard"):
        fsdp.quantize_all_gather(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="block_size"):
        fsdp.AllGatherQuantization(block_size=0)


@pytest.mark.parametrize("compressor, options, warned", [
    (compressors.OneBit(), {}, "neither momentum="), (compressors.Ternary(), {}, "neither momentum="),
    (compressors.TopK(ratio=0.01), {"adam_betas": (0.9, 0.999)}, "consider Ternary()"),
    (compressors.RandomK(ratio=0.1), {"adam_betas": (0.9, 0.999)}, "consider Ternary()"),
    (compressors.OneBit(), {"momentum": 0.9}, None), (compressors.OneBit(), {"adam_betas": (0.9, 0.999)}, None),
    (compressors.TopK(ratio=0.01), {"momentum": 0.9}, None), (compressors.BF16(), {}, None),
])
def test_options_that_lost_accuracy_say_so(caplog: pytest.LogCaptureFixture, compressor: compressors.Compressor,
                                           options: dict, warned: Optional[str]) -> None:
    """Compressed gradients for an optimizer with momentum, and top-k or random-k with Adam in
    the communication, lost accuracy in docs/results/fsdp_training.md: the state says so once
    when made; the options that kept it say nothing."""
    with caplog.at_level(logging.WARNING, logger="ddlcomm.fsdp"):
        fsdp.FSDPCompressionState(compressor, **options)
    if warned is None:
        assert not caplog.records, caplog.text
    else:
        assert len(caplog.records) == 1 and warned in caplog.text, caplog.text
