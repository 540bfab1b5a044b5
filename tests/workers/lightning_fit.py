"""Lightning's automatic optimization with a ddlcomm hook: run under torchrun (2 ranks, CPU) by
tests/test_lightning.py.

The documented use inside Lightning: ``configure_optimizers`` returns a ``ddlcomm.optim``
optimizer, and ``on_fit_start`` registers the hook on the DDP model Lightning built, with that
optimizer; or the module returns torch's own SGD (with a scheduler) and the hook converts it in
place. Lightning then calls ``optimizer.step(closure)``: forward and backward (and with them the
hook) run inside ``step()``. The same model is fitted without the hook and with the 1-bit hook
both ways; rank 0 prints one JSON line with what the test checks.
"""

from __future__ import annotations

import json
import sys

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy

from ddlcomm import compressors, hooks, optim

FEATURES, CLASSES, SAMPLES = 32, 4, 2048


def data() -> torch.utils.data.TensorDataset:
    """A linearly separable task with label noise, the same on every rank (Lightning's
    DistributedSampler gives each rank its half)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, FEATURES, generator=g)
    y = (x @ torch.randn(FEATURES, CLASSES, generator=g)).argmax(1)
    flip = torch.rand(SAMPLES, generator=g) < 0.05
    y[flip] = torch.randint(0, CLASSES, (int(flip.sum()),), generator=g)
    return torch.utils.data.TensorDataset(x, y)


class Net(L.LightningModule):
    def __init__(self, compress: bool, torch_optimizer: bool = False) -> None:
        super().__init__()
        self.torch_optimizer = torch_optimizer
        torch.manual_seed(1)
        self.net = torch.nn.Sequential(torch.nn.Linear(FEATURES, 256), torch.nn.ReLU(), torch.nn.Linear(256, CLASSES))
        self.compress = compress
        self.state: hooks.CompressionState | None = None

    def training_step(self, batch, _index):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        make = torch.optim.SGD if self.torch_optimizer else optim.SGD  # ddlcomm's: a drop-in torch.optim.SGD
        opt = make(self.parameters(), lr=0.05, momentum=0.9)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=40, gamma=0.5)}

    def on_fit_start(self) -> None:
        if self.compress:
            self.state = hooks.CompressionState(compressor=compressors.OneBit(), optimizer=self.trainer.optimizers[0],
                                                model=self, start_compress_iter=4, min_compression_bytes=0)
            self.trainer.strategy.model.register_comm_hook(self.state, hooks.compressed_hook)


def fit(compress: bool, torch_optimizer: bool = False) -> dict:
    model = Net(compress, torch_optimizer)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=DDPStrategy(process_group_backend="ddlcomm"),
                        max_epochs=3, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    loader = torch.utils.data.DataLoader(data(), batch_size=32, shuffle=True,
                                         generator=torch.Generator().manual_seed(2))
    trainer.fit(model, loader)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    everyone = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, flat)
    x, y = data().tensors
    with torch.no_grad():
        accuracy = (model.net(x).argmax(1) == y).float().mean().item()
    stats = model.state.stats if model.state else None
    return {"steps": trainer.global_step, "accuracy": accuracy, "optimizer": type(trainer.optimizers[0]).__module__,
            "checksum": float(flat.double().sum()),
            "replicas_equal": all(torch.equal(e, flat) for e in everyone),
            "compressed_buckets": stats.compressed_buckets if stats else 0, "ratio": stats.ratio if stats else 1.0}


def main() -> None:
    torch.set_num_threads(1)
    result = {"plain": fit(False), "onebit": fit(True), "onebit_torch_sgd": fit(True, torch_optimizer=True)}
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(result), flush=True)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
