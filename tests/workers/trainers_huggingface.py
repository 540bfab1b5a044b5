"""docs/huggingface.md's script, then what tests/test_trainers.py compares it with (2 CPU ranks).

``page``: runs the page's script as written (a Trainer's 128 steps with checkpoints at 64 and 128,
and a restarted Trainer that resumes from step 64: the page asserts bitwise equal parameters),
then the same training without compression; rank 0 prints ``RESULT {json}``.
``preinit``: the world initialised as a ddlcomm group before ``TrainingArguments``, then the
page's uninterrupted training; ``seed N``: the compressed and the plain training from seed N
(initialisation and data order: what the test's margin was derived from).
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may reach the Hub

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from trainers_common import flat, quality, replicas_equal, report, run_page  # noqa: E402


def measure(page: dict, trainer, compression) -> dict:
    task = page["Task"]()
    model = trainer.model.eval()
    result = {**quality(lambda ids: model(input_ids=ids).logits, task.ids, task.labels),
              "replicas_equal": replicas_equal(model), "checksum": float(flat(model).double().sum()),
              "max_grad_norm_restored": trainer.args.max_grad_norm}
    if compression is not None:
        state = compression.state
        result.update(iter=state.iter, start_compress_iter=state.start_compress_iter,
                      compressed_buckets=state.stats.compressed_buckets, uncompressed_buckets=state.stats.uncompressed_buckets,
                      ratio=state.stats.ratio, compression_ratio=state.stats.compression_ratio,
                      max_grad_norm=state.max_grad_norm,
                      grad_norm=None if state.grad_norm is None else float(state.grad_norm),
                      optimizer=f"{type(state.optimizer).__module__}.{type(state.optimizer).__name__}")
    return result


def page_and_comparisons() -> None:
    page = run_page("huggingface.md")
    plain, _ = page["make_trainer"](compressor=None, output_dir="plain")
    plain.train()
    report({
        "world_backend": dist.get_backend(),
        "saved": sorted(os.listdir("run/checkpoint-64")),
        "straight": measure(page, page["trainer"], None),
        "resumed": measure(page, page["restarted"], page["compression"]),
        "plain": measure(page, plain, None),
        "resume_bitwise": torch.equal(flat(page["trainer"].model), flat(page["restarted"].model)),
    })


def preinit() -> None:
    dist.init_process_group("ddlcomm")
    page = run_page("huggingface.md", definitions_only=True)
    trainer, compression = page["make_trainer"]()
    trainer.train()
    report({"world_backend": dist.get_backend(), "result": measure(page, trainer, compression)})


def alone() -> None:
    """One process without torch.distributed (a plain ``python``): the model is not DDP, which
    the callback says once; ``ddp_backend="ddlcomm"`` on CPU is refused by Accelerate when
    ``TrainingArguments`` sets up its devices under a launcher's environment."""
    import json
    import logging

    from transformers import TrainingArguments

    from ddlcomm.huggingface import CompressionCallback

    said: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("ddlcomm.huggingface").addHandler(handler)
    page = run_page("huggingface.md", definitions_only=True)
    trainer, compression = page["make_trainer"](output_dir="alone")
    trainer.args.max_steps = 2
    trainer.train()
    trainer.train()
    os.environ.update(WORLD_SIZE="2", RANK="0", LOCAL_RANK="0")  # as a launcher sets them: no rendezvous yet
    try:
        TrainingArguments(output_dir="refused", use_cpu=True, ddp_backend="ddlcomm").device
        refusal = ""
    except ValueError as error:
        refusal = str(error)
    print("RESULT " + json.dumps({"state": compression.state is not None, "steps": trainer.state.global_step,
                                  "warnings": said, "refusal": refusal}), flush=True)


def seeded(seed: str) -> None:
    page = run_page("huggingface.md", definitions_only=True,
                    replace={"torch.manual_seed(1)": f"torch.manual_seed({seed})", "seed=1,": f"seed={seed},"})
    compressed, compression = page["make_trainer"](output_dir="compressed")
    compressed.train()
    plain, _ = page["make_trainer"](compressor=None, output_dir="plain")
    plain.train()
    report({"seed": seed, "compressed": measure(page, compressed, compression), "plain": measure(page, plain, None)})


if __name__ == "__main__":
    torch.set_num_threads(1)
    from common import run

    run()  # the function tests/harness.py's launch names
