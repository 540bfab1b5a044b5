"""docs/lightning.md's script, then what tests/test_trainers.py compares it with (2 CPU ranks).

``page``: runs the page's script as written (two epochs, a checkpoint, a resumed fit to four),
then the same compressed fit straight through, the same fit without the callback, and the
fits the callback must refuse or leave uncompressed; rank 0 prints ``RESULT {json}``.
``seed N``: the compressed and the plain fit with model initialisation and data order N
(what the test's margin was derived from). ``diloco``: the page's fit with ``DiLoCoCallback``
(replicas probed after every outer step and halfway between two), a checkpoint between two
syncs resumed, the plain fit, and what the callback refuses or cannot run; ``diloco_seeded N``:
the DiLoCo and the plain fit from seed N.
"""

from __future__ import annotations

import logging
import os

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy

from ddlcomm.compressors import Ternary
from ddlcomm.lightning import CompressionCallback, DiLoCoCallback
from trainers_common import equal_on_every_rank, flat, quality, replicas_equal, report, run_page


class Said(logging.Handler):
    """Keeps the warnings ``ddlcomm.lightning`` logs."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def measure(page: dict, model: L.LightningModule, callback: CompressionCallback | None) -> dict:
    x, y = page["data"]().tensors
    result = {**quality(model.net, x, y), "replicas_equal": replicas_equal(model)}
    if callback is not None:
        state = callback.state
        result.update(iter=state.iter, start_compress_iter=state.start_compress_iter,
                      compressed_buckets=state.stats.compressed_buckets, ratio=state.stats.ratio,
                      compression_ratio=state.stats.compression_ratio, max_grad_norm=state.max_grad_norm,
                      grad_norm=float(state.grad_norm), optimizer=type(state.optimizer).__module__)
    return result


def refused(page: dict, **trainer_options) -> str:
    """The error a one-step fit with ``trainer_options`` raises with the callback ('' if none)."""
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=DDPStrategy(process_group_backend="ddlcomm"),
                        max_steps=1, callbacks=[CompressionCallback(Ternary())], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        **trainer_options)
    loader = torch.utils.data.DataLoader(page["data"](), batch_size=32)
    try:
        trainer.fit(page["Net"](), loader)
    except ValueError as error:
        return str(error)
    return ""


def one_device_fit(page: dict, callback: L.Callback) -> tuple[list[str], int]:
    """A fit of one process on one device with ``callback``: the warnings ddlcomm.lightning
    logged, and the steps taken."""
    said = Said()
    logging.getLogger("ddlcomm.lightning").addHandler(said)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=3, callbacks=[callback], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(page["Net"](), torch.utils.data.DataLoader(page["data"](), batch_size=32))
    logging.getLogger("ddlcomm.lightning").removeHandler(said)
    return said.messages, trainer.global_step


def without_ddp(page: dict) -> dict:
    """One process's fit on one device: the callback says once that it cannot run."""
    callback = CompressionCallback(Ternary())
    warnings, steps = one_device_fit(page, callback)
    return {"state": callback.state is not None, "warnings": warnings, "steps": steps}


def adam_resume(page: dict) -> dict:
    """The page's checkpoint and resume with AdamW, whose moments differ between ranks under a
    lossy compressor (each rank's own must come back, not rank 0's that Lightning saved)."""
    class AdamNet(page["Net"]):
        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    page["fit"](AdamNet(), 2, [CompressionCallback(Ternary())]).save_checkpoint("adam-half.ckpt")
    resumed = AdamNet()
    page["fit"](resumed, 4, [CompressionCallback(Ternary())], ckpt_path="adam-half.ckpt")
    straight, callback = AdamNet(), CompressionCallback(Ternary())
    page["fit"](straight, 4, [callback])
    moments = torch.cat([s["exp_avg"].reshape(-1) for s in callback.state.optimizer.state.values()])
    return {"resume_bitwise": torch.equal(flat(resumed), flat(straight)),
            "moments_differ_between_ranks": not equal_on_every_rank(moments)}


def page_and_comparisons() -> None:
    page = run_page("lightning.md")
    resumed, trainer = page["model"], page["trainer"]
    clip_after = trainer.gradient_clip_val
    straight_callback = CompressionCallback(Ternary())
    straight = page["Net"]()
    page["fit"](straight, 4, [straight_callback])
    plain = page["Net"]()
    page["fit"](plain, 4, [])
    result = {
        "steps": trainer.global_step,
        "resumed": measure(page, resumed, page["compression"]),
        "straight": measure(page, straight, straight_callback),
        "plain": measure(page, plain, None),
        "resume_bitwise": torch.equal(flat(resumed), flat(straight)),
        "clip_restored": clip_after == 0.5,
        "refused_value_clipping": refused(page, gradient_clip_val=0.5, gradient_clip_algorithm="value"),
        "without_ddp": without_ddp(page),
        "adam": adam_resume(page),
    }
    report(result)


def seeded(seed: str) -> None:
    """The straight compressed fit and the plain one, from initialisation and data order ``seed``."""
    os.environ["PL_GLOBAL_SEED"] = str(seed)  # Lightning's DistributedSampler seed
    page = run_page("lightning.md", definitions_only=True)

    def net() -> L.LightningModule:
        return seeded_net(page, int(seed))

    compressed, callback, plain = net(), CompressionCallback(Ternary()), net()
    page["fit"](compressed, 4, [callback])
    page["fit"](plain, 4, [])
    report({"seed": seed, "compressed": measure(page, compressed, callback), "plain": measure(page, plain, None)})


class Probe(L.Callback):
    """After ``DiLoCoCallback`` in the Trainer's list: whether the replicas are bitwise equal
    after each outer step, and halfway between two (where each trained on its own gradients),
    and at the end of a warm-up."""

    def __init__(self, diloco: DiLoCoCallback) -> None:
        self.callback, self.after_sync, self.between, self.outer, self.warmed = diloco, [], [], 0, None

    def on_train_start(self, trainer, pl_module) -> None:
        diloco = self.callback.diloco
        self.outer = diloco.outer_steps if diloco is not None else 0  # a resumed fit's

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        diloco = self.callback.diloco
        if diloco is None:
            return
        if self.warmed is None and self.callback.warmup_steps:
            self.warmed = {"step": trainer.global_step, "replicas_equal": replicas_equal(pl_module)}
        if diloco.outer_steps != self.outer:
            self.outer = diloco.outer_steps
            self.after_sync.append(replicas_equal(pl_module))
        elif (diloco.inner_steps % diloco.sync_every == diloco.sync_every // 2
              and len(self.between) < diloco.outer_steps):
            self.between.append(replicas_equal(pl_module))


def diloco_fit(page: dict, model: L.LightningModule, epochs: int, ckpt_path: str | None = None, **options) -> dict:
    callback = DiLoCoCallback(Ternary(), **{"sync_every": 8, **options})
    probe = Probe(callback)
    trainer = page["fit"](model, epochs, [callback, probe], ckpt_path=ckpt_path)
    d = callback.diloco
    x, y = page["data"]().tensors
    return {**quality(model.net, x, y), "replicas_equal": replicas_equal(model), "steps": trainer.global_step,
            "inner_steps": d.inner_steps, "outer_steps": d.outer_steps, "bytes_sent": d.stats.bytes_sent,
            "bytes_uncompressed": d.stats.bytes_uncompressed, "after_sync": probe.after_sync,
            "between": probe.between, "warmed": probe.warmed, "trainer": trainer, "callback": callback}


def diloco_refused(page: dict) -> str:
    """The error a fit with both callbacks raises ('' if none)."""
    try:
        page["fit"](page["Net"](), 1, [CompressionCallback(Ternary()), DiLoCoCallback(Ternary())])
    except ValueError as error:
        return str(error)
    return ""


def diloco_without_ddp(page: dict) -> dict:
    callback = DiLoCoCallback(Ternary(), sync_every=2)
    warnings, steps = one_device_fit(page, callback)
    return {"diloco": callback.diloco is not None, "warnings": warnings, "steps": steps}


def seeded_net(page: dict, seed: int) -> L.LightningModule:
    """The page's ``Net``, its layers initialised from ``seed`` (the same on every rank)."""
    model = page["Net"]()
    torch.manual_seed(seed)
    for layer in model.net:
        if hasattr(layer, "reset_parameters"):
            layer.reset_parameters()
    return model


def every_rank(flag: bool) -> bool:
    """Whether ``flag`` holds on every rank (each rank's replica differs between syncs)."""
    held = torch.tensor([int(flag)])
    torch.distributed.all_reduce(held, op=torch.distributed.ReduceOp.MIN)
    return bool(held.item())


def diloco() -> None:
    page = run_page("lightning.md", definitions_only=True)
    fitted = diloco_fit(page, page["Net"](), 4)
    plain = page["Net"]()
    page["fit"](plain, 4, [])
    # A checkpoint between two syncs (2 epochs: 32 steps, sync_every=10), resumed to 4 epochs,
    # against the same fit straight through (no sync at the end of either part).
    half = diloco_fit(page, page["Net"](), 2, sync_every=10, sync_at_end=False)
    half.pop("trainer").save_checkpoint("diloco-half.ckpt")
    resumed_model, straight_model = page["Net"](), page["Net"]()
    resumed = diloco_fit(page, resumed_model, 4, ckpt_path="diloco-half.ckpt", sync_every=10, sync_at_end=False)
    straight = diloco_fit(page, straight_model, 4, sync_every=10, sync_at_end=False)
    # A warm-up of 8 plain DDP steps, then DiLoCo for the other 8 of one epoch.
    warm = diloco_fit(page, page["Net"](), 1, sync_every=4, warmup_steps=8)
    for r in (fitted, half, resumed, straight, warm):
        r.pop("trainer", None), r.pop("callback")
    report({"diloco": fitted, "plain": measure(page, plain, None), "half": half, "resumed": resumed,
            "straight": straight, "warm": warm,
            "resume_bitwise": every_rank(torch.equal(flat(resumed_model), flat(straight_model))),
            "refused_with_compression": diloco_refused(page), "without_ddp": diloco_without_ddp(page)})


def diloco_seeded(seed: str) -> None:
    """The DiLoCo fit and the plain one from initialisation and data order ``seed``."""
    os.environ["PL_GLOBAL_SEED"] = str(seed)
    page = run_page("lightning.md", definitions_only=True)

    def net() -> L.LightningModule:
        return seeded_net(page, int(seed))

    fitted = diloco_fit(page, net(), 4)
    fitted.pop("trainer"), fitted.pop("callback")
    plain = net()
    page["fit"](plain, 4, [])
    report({"seed": seed, "diloco": fitted, "plain": measure(page, plain, None)})


if __name__ == "__main__":
    torch.set_num_threads(1)
    from common import run

    run()  # the function tests/harness.py's launch names
