"""ddlcomm inside the trainers people use: Lightning (``ddlcomm.lightning``), Accelerate
(``ddlcomm.accelerate``) and the Hugging Face Trainer (``ddlcomm.huggingface``), 2 CPU ranks.

Each worker (tests/workers/trainers_*.py) first runs its docs page's script as written
(docs/lightning.md, docs/accelerate.md, docs/huggingface.md: the worker executes the page's
```python block), then the same training straight through and without compression. Checked:
compression was used (the hook's iterations and bytes), the result is within a margin of the
uncompressed one, a run checkpointed halfway and resumed ends with bitwise the parameters of
the uninterrupted one, and every rank exits 0.

Marked ``trainers``: scripts/test.sh runs them as a step of their own (scripts/setup.sh installs
the pinned frameworks).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from harness import RankResult, assert_all_ok, launch
from workers import trainers_accelerate, trainers_huggingface, trainers_lightning

pytestmark = pytest.mark.trainers

# Accuracy and loss margins against the same fit without compression: three standard deviations
# of the difference of two independent fits (sqrt(2) times one fit's), one fit's measured over
# five seeds (initialisation and data order) of the fit without compression (each worker's
# ``seeded N`` scenario). One-sided: doing better than without compression passes.
LIGHTNING_ACCURACY_MARGIN = 0.015
LIGHTNING_LOSS_MARGIN = 0.016
ACCELERATE_ACCURACY_MARGIN = 0.026
ACCELERATE_LOSS_MARGIN = 0.013
HUGGINGFACE_ACCURACY_MARGIN = 0.028
HUGGINGFACE_LOSS_MARGIN = 0.079
# DiLoCoCallback against the plain DDP fit of the same page task: DiLoCo trains another
# trajectory (each replica on its own gradients for sync_every steps, then an outer Nesterov
# step), so its gap is systematic, not only noise. The margin is the mean gap plus three
# standard deviations of the gap, over five seeds of the pair (trainers_lightning.py's
# ``diloco_seeded N``, N = 0..4). One-sided.
LIGHTNING_DILOCO_ACCURACY_MARGIN = 0.027
LIGHTNING_DILOCO_LOSS_MARGIN = 0.111
# Nothing here may reach the Hub (the workers set it too, before importing transformers).
HF_ENV = {"HF_HUB_OFFLINE": "1"}


def _needs(module: str) -> None:
    if not os.environ.get("CI"):  # CI has them (scripts/setup.sh): there a missing install fails
        pytest.importorskip(module, reason=f"{module} is not installed (scripts/setup.sh installs it)")


def _result(results: list[RankResult]) -> dict:
    assert_all_ok(results)
    line = next(line for line in results[0].output.splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def test_lightning_callback_compresses_clips_resumes_and_says_when_it_cannot() -> None:
    """docs/lightning.md's script (``accumulate_grad_batches=2``, ``gradient_clip_val=0.5``, a
    checkpoint after two epochs and a resumed fit to four), the same fit straight through and
    without the callback."""
    _needs("lightning")
    result = _result(launch(trainers_lightning.page_and_comparisons, 2, timeout=240))
    resumed, straight, plain = result["resumed"], result["straight"], result["plain"]
    steps = result["steps"]
    # Compression used: the torch SGD converted in place, one bucket a step after the warm-up.
    assert resumed["iter"] == straight["iter"] == steps > resumed["start_compress_iter"], result
    assert straight["compressed_buckets"] == steps - straight["start_compress_iter"], result
    assert straight["optimizer"] == "ddlcomm.optim", result
    assert straight["compression_ratio"] > 10 and straight["ratio"] > 3, result
    # gradient_clip_val became the hook's clipping, and went back to the Trainer after the fit.
    assert straight["max_grad_norm"] == 0.5 and straight["grad_norm"] > 0 and result["clip_restored"], result
    # Checkpointed after two epochs and resumed: bitwise the uninterrupted fit, also with AdamW,
    # whose per-rank moments come back from the callback's state (each rank's differ).
    assert result["resume_bitwise"], result
    assert result["adam"]["moments_differ_between_ranks"] and result["adam"]["resume_bitwise"], result
    assert resumed["replicas_equal"] and straight["replicas_equal"] and plain["replicas_equal"], result
    assert straight["accuracy"] >= plain["accuracy"] - LIGHTNING_ACCURACY_MARGIN, result
    assert straight["loss"] <= plain["loss"] + LIGHTNING_LOSS_MARGIN, result
    # Refused where it would be silently wrong; said once where it cannot run.
    assert "gradient_clip_algorithm='value'" in result["refused_value_clipping"], result
    alone = result["without_ddp"]
    assert not alone["state"] and alone["steps"] == 3 and len(alone["warnings"]) == 1, result
    assert "does not run" in alone["warnings"][0], result


def test_lightning_diloco_callback_syncs_compressed_resumes_between_syncs_and_refuses() -> None:
    """docs/lightning.md's fit (``accumulate_grad_batches=2``, ``gradient_clip_val=0.5``) with
    ``DiLoCoCallback(Ternary(), sync_every=8)``, the plain fit, a checkpoint between two syncs
    resumed against the same fit straight through, a warm-up, and what the callback refuses or
    cannot run."""
    _needs("lightning")
    result = _result(launch(trainers_lightning.diloco, 2, timeout=240))
    d, plain = result["diloco"], result["plain"]
    # One DiLoCo step per optimizer step (not per micro-batch), an outer step every 8.
    assert d["inner_steps"] == d["steps"] == 64 and d["outer_steps"] == 8, result
    # The outer steps were compressed: well under float32 pseudo-gradients (a plain all-reduce
    # of the model at each outer step, stats.bytes_uncompressed / sync_every).
    assert 0 < d["bytes_sent"] < d["bytes_uncompressed"] / 8 / 8, result
    # Bitwise equal replicas right after every outer step, and different halfway between two:
    # the inner steps did not communicate.
    assert d["after_sync"] == [True] * 8 and d["between"] and not any(d["between"]), result
    assert d["replicas_equal"], result
    assert d["accuracy"] >= plain["accuracy"] - LIGHTNING_DILOCO_ACCURACY_MARGIN, result
    assert d["loss"] <= plain["loss"] + LIGHTNING_DILOCO_LOSS_MARGIN, result
    # Checkpointed after 32 steps (sync_every=10: between two syncs), resumed: every rank's
    # replica bitwise the uninterrupted fit's.
    half, resumed, straight = result["half"], result["resumed"], result["straight"]
    assert half["outer_steps"] == 3 and resumed["outer_steps"] == straight["outer_steps"] == 6, result
    assert result["resume_bitwise"] and all(resumed["after_sync"]), result
    # warmup_steps=8 of one epoch's 16: plain DDP (replicas equal when DiLoCo starts), then
    # DiLoCo's 8 inner steps and 2 outer steps.
    warm = result["warm"]
    assert warm["warmed"] == {"step": 8, "replicas_equal": True}, result
    assert warm["inner_steps"] == 8 and warm["outer_steps"] == 2 and warm["after_sync"] == [True, True], result
    assert "CompressionCallback" in result["refused_with_compression"], result
    alone = result["without_ddp"]
    assert not alone["diloco"] and alone["steps"] == 3 and len(alone["warnings"]) == 1, result
    assert "does not run" in alone["warnings"][0], result


def test_accelerate_hook_compresses_resumes_and_trains_alike_on_gloo_and_ddlcomm_groups() -> None:
    """docs/accelerate.md's script (``accumulate``, ``max_grad_norm``, ``save_state`` after two
    epochs and a restarted job that ``load_state``s, on Accelerate's gloo group), the same run
    straight through, through a ddlcomm group beside Accelerate's, without compression, and
    (another launch) with the world initialised as a ddlcomm group before Accelerate."""
    _needs("accelerate")
    result = _result(launch(trainers_accelerate.page_and_comparisons, 2, timeout=240))
    resumed, straight, plain = result["resumed"], result["straight"], result["plain"]
    assert result["distributed_type"] == "DistributedType.MULTI_CPU" and result["world_backend"] == "gloo", result
    assert result["hook_group_backend"] == "ddlcomm", result
    assert resumed["iter"] == straight["iter"] == 64 and straight["optimizer"] == "ddlcomm.optim", result
    assert straight["compressed_buckets"] == straight["iter"] - straight["start_compress_iter"], result
    assert straight["compression_ratio"] > 10 and straight["ratio"] > 3 and straight["grad_norm"] > 0, result
    assert result["resume_bitwise"] and result["ddlcomm_group_bitwise"], result
    assert all(r["replicas_equal"] for r in (resumed, straight, plain, result["ddlcomm_group"])), result
    assert straight["accuracy"] >= plain["accuracy"] - ACCELERATE_ACCURACY_MARGIN, result
    assert straight["loss"] <= plain["loss"] + ACCELERATE_LOSS_MARGIN, result
    first = _result(launch(trainers_accelerate.preinit, 2, timeout=120))
    assert first["world_backend"] == "ddlcomm" and first["accelerate_backend"] == "gloo", first
    assert first["distributed_type"] == "DistributedType.MULTI_CPU", first
    assert first["result"]["checksum"] == straight["checksum"], (first, result)


def test_accelerate_refuses_the_ddlcomm_backend_on_cpu_and_the_hook_says_when_it_cannot_run() -> None:
    """What docs/accelerate.md quotes: ``backend="ddlcomm"`` is refused on a multi-process CPU
    run (before any rendezvous), and ``Accelerator()`` without ``cpu=True`` trains each process
    alone, which ``register_hook`` says once."""
    _needs("accelerate")
    env = dict(os.environ, WORLD_SIZE="2", RANK="0", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    refused = subprocess.run([sys.executable, "-c", "from accelerate.state import PartialState\n"
                              "PartialState(cpu=True, backend='ddlcomm')"], env=env, capture_output=True,
                             text=True, timeout=120, cwd=tempfile.gettempdir())
    assert refused.returncode != 0, refused.stdout + refused.stderr
    assert "ValueError: Your assigned backend ddlcomm is not available, please use gloo" in refused.stderr, refused.stderr
    alone = _result(launch(trainers_accelerate.alone, 2, timeout=120))
    assert alone["distributed_type"] == "DistributedType.NO" and alone["states"] == [False, False], alone
    assert len(alone["warnings"]) == 1 and "Accelerator(cpu=True)" in alone["warnings"][0], alone


def test_huggingface_trainer_callback_compresses_clips_and_resumes_bitwise() -> None:
    """docs/huggingface.md's script (a tiny BERT from a config, AdamW built by the Trainer,
    gradient accumulation, ``max_grad_norm``, checkpoints, a restarted Trainer resuming from the
    middle one: the page asserts bitwise equal parameters), the same training without
    compression, and (another launch) with the world initialised as a ddlcomm group first."""
    _needs("transformers")
    result = _result(launch(trainers_huggingface.page_and_comparisons, 2, timeout=300))
    resumed, straight, plain = result["resumed"], result["straight"], result["plain"]
    assert result["world_backend"] == "gloo", result
    assert {"ddlcomm_compression_rank0.pt", "ddlcomm_compression_rank1.pt", "optimizer.pt"} <= set(result["saved"])
    assert resumed["iter"] == 128 and resumed["optimizer"] == "ddlcomm.optim.AdamW", result
    assert resumed["compressed_buckets"] >= resumed["iter"] - resumed["start_compress_iter"], result
    assert resumed["compression_ratio"] > 10 and resumed["ratio"] > 3, result
    # The Trainer's max_grad_norm clipped in the hook, and went back to TrainingArguments after train().
    assert resumed["max_grad_norm"] == 1.0 and resumed["grad_norm"] > 0, result
    assert resumed["max_grad_norm_restored"] == straight["max_grad_norm_restored"] == 1.0, result
    assert result["resume_bitwise"] and resumed["checksum"] == straight["checksum"], result
    assert resumed["replicas_equal"] and plain["replicas_equal"], result
    assert straight["accuracy"] >= plain["accuracy"] - HUGGINGFACE_ACCURACY_MARGIN, result
    assert straight["loss"] <= plain["loss"] + HUGGINGFACE_LOSS_MARGIN, result
    first = _result(launch(trainers_huggingface.preinit, 2, timeout=180))
    assert first["world_backend"] == "ddlcomm" and first["result"]["checksum"] == straight["checksum"], first


def test_huggingface_callback_says_when_it_cannot_run_and_the_ddlcomm_backend_is_refused_on_cpu() -> None:
    """One process (a plain ``python``): the model is not DDP, said once over two ``train()``
    calls; ``TrainingArguments(use_cpu=True, ddp_backend="ddlcomm")`` under a launcher's
    environment is refused by Accelerate (docs/huggingface.md)."""
    _needs("transformers")
    worker = Path(__file__).parent / "workers" / "trainers_huggingface.py"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT")}
    with tempfile.TemporaryDirectory() as cwd:
        done = subprocess.run([sys.executable, str(worker), "alone"], env=dict(env, **HF_ENV, OMP_NUM_THREADS="1"),
                              capture_output=True, text=True, timeout=180, cwd=cwd)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))
    alone = json.loads(line[len("RESULT "):])
    assert not alone["state"] and alone["steps"] == 2 and len(alone["warnings"]) == 1, alone
    assert "not DistributedDataParallel" in alone["warnings"][0], alone
    assert alone["refusal"] == "Your assigned backend ddlcomm is not available, please use gloo", alone
