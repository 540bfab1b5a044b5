"""docs/accelerate.md's script, then what tests/test_trainers.py compares it with (2 CPU ranks).

``page``: runs the page's script as written (two epochs, ``save_state``, a restarted job that
``load_state``s and trains to four, on Accelerate's gloo group), then the same training straight
through, through a ddlcomm group beside Accelerate's (``process_group=``), and without
compression; rank 0 prints ``RESULT {json}``.
``preinit``: the world initialised as a ddlcomm group before Accelerate, then the page's straight
training; ``seed N``: the compressed and the plain training from seed N (initialisation and data
order: what the test's margin was derived from).
"""

from __future__ import annotations


import torch
import torch.distributed as dist

from trainers_common import flat, quality, replicas_equal, report, run_page


def measure(page: dict, model: torch.nn.Module, state) -> dict:
    x, y = page["data"]().tensors
    result = {**quality(model.module, x, y), "replicas_equal": replicas_equal(model),
              "checksum": float(flat(model).double().sum())}
    if state is not None:
        result.update(iter=state.iter, start_compress_iter=state.start_compress_iter,
                      compressed_buckets=state.stats.compressed_buckets, ratio=state.stats.ratio,
                      compression_ratio=state.stats.compression_ratio, grad_norm=float(state.grad_norm),
                      optimizer=type(state.optimizer).__module__)
    return result


def page_and_comparisons() -> None:
    page = run_page("accelerate.md")
    accelerator, resumed, state = page["accelerator"], page["model"], page["state"]
    _, straight, straight_state = page["train"](4)
    ddlcomm_group = dist.new_group(backend="ddlcomm")
    _, grouped, grouped_state = page["train"](4, group=ddlcomm_group)
    _, plain, _ = page["train"](4, compressor=None)
    report({
        "distributed_type": str(accelerator.distributed_type),
        "world_backend": dist.get_backend(),
        "hook_group_backend": dist.get_backend(ddlcomm_group),
        "resumed": measure(page, resumed, state),
        "straight": measure(page, straight, straight_state),
        "ddlcomm_group": measure(page, grouped, grouped_state),
        "plain": measure(page, plain, None),
        "resume_bitwise": torch.equal(flat(resumed), flat(straight)),
        "ddlcomm_group_bitwise": torch.equal(flat(grouped), flat(straight)),
    })


def preinit() -> None:
    dist.init_process_group("ddlcomm")
    page = run_page("accelerate.md", definitions_only=True)
    accelerator, model, state = page["train"](4)
    report({"distributed_type": str(accelerator.distributed_type), "world_backend": dist.get_backend(),
            "accelerate_backend": accelerator.state.backend, "result": measure(page, model, state)})


def alone() -> None:
    """``Accelerator()`` without ``cpu=True`` on a machine without a GPU: every process trains
    alone, which ``register_hook`` says once (and registers nothing)."""
    import logging

    from accelerate import Accelerator

    from ddlcomm.accelerate import register_hook

    said: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("ddlcomm.accelerate").addHandler(handler)
    accelerator = Accelerator()
    model = accelerator.prepare(torch.nn.Linear(4, 4))
    states = [register_hook(accelerator, model) for _ in range(2)]
    report({"distributed_type": str(accelerator.distributed_type), "states": [s is not None for s in states],
            "warnings": said})


def seeded(seed: str) -> None:
    page = run_page("accelerate.md", definitions_only=True,
                    replace={"torch.manual_seed(1)": f"torch.manual_seed({seed})"})
    _, compressed, state = page["train"](4)
    _, plain, _ = page["train"](4, compressor=None)
    report({"seed": seed, "compressed": measure(page, compressed, state), "plain": measure(page, plain, None)})


if __name__ == "__main__":
    torch.set_num_threads(1)
    from common import run

    run()  # the function tests/harness.py's launch names
