"""``opt.step(closure)`` with a compressed hook, run on every rank by tests/test_optim.py."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from common import init, run
from compression import COMPRESSORS, flat_params, small_model, synthetic
from ddlcomm import hooks, optim


def _closure(ddp, opt, x, y, step: int, rank: int):
    """One step's closure as Lightning's automatic optimization writes it: zero_grad, forward,
    backward, the loss."""
    idx = torch.randint(0, len(x), (32,), generator=torch.Generator().manual_seed(step * 97 + rank))

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(ddp(x[idx]), y[idx])
        loss.backward()
        return loss

    return closure


def closure_steps() -> None:
    """``opt.step(closure)`` (Lightning's automatic optimization, L-BFGS-style loops: forward and
    backward run inside step()) with a compressed hook averaging ddlcomm.optim's directions
    trains bit for bit as ``closure(); opt.step()``: the directions arrive while step() runs the
    closure, and step() must apply them rather than take them for gradients. step() returns the
    closure's loss, and every rank holds the same parameters."""
    rank, n = init()
    gloo = dist.new_group(backend="gloo")
    x, y = synthetic(rank)
    optimizers = {
        "sgd_momentum": lambda ps: optim.SGD(ps, lr=0.05, momentum=0.9),
        "adamw": lambda ps: optim.AdamW(ps, lr=1e-2),
    }
    for opt_name, make_opt in optimizers.items():
        for comp_name in ("onebit", "topk"):
            trained, losses = {}, {}
            for style in ("closure", "separate"):
                model = small_model()
                opt = make_opt(model.parameters())
                ddp = DistributedDataParallel(model, bucket_cap_mb=0.1)
                state = hooks.CompressionState(None, COMPRESSORS[comp_name](), start_compress_iter=2,
                                               min_compression_bytes=0, optimizer=opt)
                ddp.register_comm_hook(state, hooks.compressed_hook)
                losses[style] = []
                for step in range(6):
                    closure = _closure(ddp, opt, x, y, step, rank)
                    if style == "closure":
                        loss = opt.step(closure)
                    else:
                        loss = closure()
                        opt.step()
                    losses[style].append(float(loss.detach()))
                assert state.stats.compressed_buckets > 0 and state.stats.uncompressed_buckets > 0
                trained[style] = flat_params(model)
            what = f"{opt_name} + {comp_name}"
            assert losses["closure"] == losses["separate"], f"{what}: step(closure) returned other losses"
            assert torch.equal(trained["closure"], trained["separate"]), \
                f"{what}: step(closure) trained otherwise than closure(); step()"
            everyone = [torch.empty_like(trained["closure"]) for _ in range(n)]
            dist.all_gather(everyone, trained["closure"], group=gloo)
            assert all(torch.equal(e, trained["closure"]) for e in everyone), f"{what}: ranks hold different parameters"


if __name__ == "__main__":
    run()
