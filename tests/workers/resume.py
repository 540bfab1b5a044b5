"""Checkpoint and resume of the compressed DDP hooks, run on every rank by tests/test_resume.py.

The reference is one uninterrupted run. The resumed run trains part of the way, saves the
model, the optimizer and the hook state of each rank, then continues in a fresh model, DDP
wrapper, optimizer and hook state (as a restarted job does): DDP's first iteration in a fresh
wrapper uses another bucket layout than the rebuilt one the uninterrupted run has by then.
"""

from __future__ import annotations

import io
import logging
import pickle

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from common import init, run
from ddlcomm import compressors, hooks, optim

STEPS, SAVE_AT = 10, 6


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
        torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10),
    )


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)


# name -> (compressor, optimizer factory, hook options); every kind of memory is covered:
# worker and server residuals (quantizers), DGC momenta (top-k), Adam moments and random-k's
# per-bucket randomness stream.
CASES = {
    "onebit_sgd": (compressors.OneBit, lambda ps: torch.optim.SGD(ps, lr=0.05), {}),
    "ternary_momentum": (lambda: compressors.Ternary(block_size=64), lambda ps: optim.SGD(ps, lr=0.05, momentum=0.9),
                         {}),
    "topk_dgc": (lambda: compressors.TopK(ratio=0.05), lambda ps: torch.optim.SGD(ps, lr=0.05), {"momentum": 0.9}),
    "randomk_adamw": (lambda: compressors.RandomK(ratio=0.1, seed=3), lambda ps: optim.AdamW(ps, lr=3e-3), {}),
    # some buckets under min_compression_bytes: plain all-reduce beside compressed ones
    "onebit_small_buckets": (compressors.OneBit, lambda ps: torch.optim.SGD(ps, lr=0.05),
                             {"min_compression_bytes": 12_000}),
}


class Job:
    """A model, its DDP wrapper, optimizer and hook state, as a training script builds them."""

    def __init__(self, case: str, group=None, bucket_cap_mb: float = 0.01, static_graph: bool = False) -> None:
        make_compressor, make_opt, options = CASES[case]
        self.model = _model()
        self.opt = make_opt(self.model.parameters())
        self.ddp = DistributedDataParallel(self.model, process_group=group, bucket_cap_mb=bucket_cap_mb,
                                           static_graph=static_graph)
        options = {"start_compress_iter": 2, "min_compression_bytes": 0, **options}
        direction = self.opt if isinstance(self.opt, optim.DirectionOptimizer) else None
        self.state = hooks.CompressionState(group, make_compressor(), model=self.model, optimizer=direction,
                                            **options)
        self.ddp.register_comm_hook(self.state, hooks.compressed_hook)
        self.layouts: list[list[tuple[str, ...]]] = []

    def train(self, steps: int) -> None:
        rank = dist.get_rank()
        for _ in range(steps):
            x, y = _batch(self.state.iter, rank)
            self.opt.zero_grad()
            torch.nn.functional.cross_entropy(self.ddp(x), y).backward()
            self.opt.step()
            self.layouts.append(list(self.state.memory.layout))

    def save(self) -> io.BytesIO:
        buffer = io.BytesIO()
        torch.save({"model": self.model.state_dict(), "opt": self.opt.state_dict(), "hook": self.state.state_dict()},
                   buffer)
        buffer.seek(0)
        return buffer

    def load(self, buffer: io.BytesIO) -> None:
        saved = torch.load(buffer)
        self.model.load_state_dict(saved["model"])
        self.opt.load_state_dict(saved["opt"])
        self.state.load_state_dict(saved["hook"])


def refuses(error: type, call, what: str) -> str:
    """The message of the `error` that `call` must raise; `what` says what went wrong if none does."""
    try:
        call()
    except error as e:
        return str(e)
    raise AssertionError(what)


def _params(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def _same_on_every_rank(t: torch.Tensor, what: str) -> None:
    everyone = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, t)
    assert all(torch.equal(e, t) for e in everyone), f"{what}: ranks hold different parameters"


def exact(case: str, static_graph: bool = False) -> None:
    """Save after SAVE_AT steps, resume in a fresh job: bit for bit the uninterrupted run."""
    straight = Job(case, static_graph=static_graph)
    straight.train(STEPS)
    first = Job(case, static_graph=static_graph)
    first.train(SAVE_AT)
    checkpoint = first.save()
    assert first.state.memory, f"{case}: nothing to carry over: the test would prove nothing"
    resumed = Job(case, static_graph=static_graph)
    resumed.load(checkpoint)
    resumed.train(STEPS - SAVE_AT)
    assert torch.equal(_params(resumed.model), _params(straight.model)), f"{case}: resuming changed the training"
    _same_on_every_rank(_params(resumed.model), case)


def exact_resume() -> None:
    init()
    # The test only means something if a fresh wrapper starts in another layout.
    probe = Job("onebit_sgd")
    probe.train(2)
    assert probe.layouts[0] != probe.layouts[1], f"DDP did not rebuild its buckets: {probe.layouts[:2]}"
    for case in CASES:
        exact(case)
    exact("onebit_sgd", static_graph=True)
    exact("ternary_momentum", static_graph=True)


def pickled_state() -> None:
    """torch.save of the whole CompressionState resumes exactly too, once model= and optimizer=
    are set again; until then the hook refuses to run."""
    init()
    straight = Job("ternary_momentum")
    straight.train(STEPS)
    first = Job("ternary_momentum")
    first.train(SAVE_AT)
    buffer = io.BytesIO()
    torch.save({"model": first.model.state_dict(), "opt": first.opt.state_dict(), "hook": first.state}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=False)
    resumed = Job("ternary_momentum")
    resumed.model.load_state_dict(saved["model"])
    resumed.opt.load_state_dict(saved["opt"])
    state = resumed.state = saved["hook"]
    resumed.ddp = DistributedDataParallel(resumed.model, bucket_cap_mb=0.01)
    resumed.ddp.register_comm_hook(state, hooks.compressed_hook)
    e = refuses(RuntimeError, lambda: resumed.train(1), "a state pickled with optimizer= and model= ran without")
    assert "set state.optimizer" in str(e), e
    state.optimizer, state.model = resumed.opt, resumed.model
    resumed.ddp = DistributedDataParallel(resumed.model, bucket_cap_mb=0.01)  # the failed backward left DDP mid-way
    resumed.ddp.register_comm_hook(state, hooks.compressed_hook)
    resumed.train(STEPS - SAVE_AT)
    assert torch.equal(_params(resumed.model), _params(straight.model)), "resuming a pickled state changed training"


def refused() -> None:
    """States that cannot be resumed here are refused with the reason, before training."""
    rank, n = init()
    job = Job("onebit_sgd")
    job.train(4)
    mine = job.save().getvalue()
    everyone: list = [None] * n
    dist.all_gather_object(everyone, mine)

    # Another rank's state.
    other = Job("onebit_sgd")
    e = refuses(ValueError, lambda: other.load(io.BytesIO(everyone[(rank + 1) % n])),
                "rank accepted another rank's hook state")
    assert f"saved by rank {(rank + 1) % n} of {n}" in str(e) and f"on rank {rank} of {n}" in str(e), e

    # Another world size: a subgroup of 2 ranks (every rank creates it; ranks 0 and 1 use it).
    pair = dist.new_group([0, 1])
    if rank < 2:
        small = Job("onebit_sgd", group=pair)
        e = refuses(ValueError, lambda: small.state.load_state_dict(torch.load(io.BytesIO(mine))["hook"]),
                    "a state of another world size was accepted")
        assert f"of {n}" in str(e) and "of 2" in str(e), e

    # Another model: the saved memory names parameters this one does not have.
    wider = Job("onebit_sgd")
    wider.model = torch.nn.Sequential(torch.nn.Linear(32, 10))
    wider.ddp = DistributedDataParallel(wider.model, bucket_cap_mb=0.01)
    wider.state = hooks.CompressionState(None, compressors.OneBit(), start_compress_iter=2, min_compression_bytes=0,
                                         model=wider.model)
    wider.ddp.register_comm_hook(wider.state, hooks.compressed_hook)
    wider.opt = torch.optim.SGD(wider.model.parameters(), lr=0.05)
    wider.state.load_state_dict(torch.load(io.BytesIO(mine))["hook"])
    e = refuses(ValueError, lambda: wider.train(1), "a state of another model was used")
    assert "saved for another model" in str(e), e

    # Keyed by parameter names, loaded into a state keyed by optimizer positions.
    keyed = hooks.CompressionState(None, compressors.OneBit(), optimizer=optim.SGD(_model().parameters(), lr=0.1))
    e = refuses(ValueError, lambda: keyed.load_state_dict(torch.load(io.BytesIO(mine))["hook"]),
                "a state keyed by names was loaded into one keyed by optimizer positions")
    assert "model=" in str(e), e

    # Without model= or optimizer= there is nothing stable to key the memory by.
    anonymous = hooks.CompressionState(None, compressors.OneBit(), start_compress_iter=2, min_compression_bytes=0)
    model = _model()
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.01)
    ddp.register_comm_hook(anonymous, hooks.compressed_hook)
    for step in range(3):
        x, y = _batch(step, rank)
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
    for save in (anonymous.state_dict, lambda: pickle.dumps(anonymous)):
        e = refuses(ValueError, save, "an unkeyed state was saved")
        assert "model=" in str(e), e


def changed_layout() -> None:
    """Resumed with another bucket_cap_mb: the memory is remapped parameter by parameter (logged
    once), training goes on with every rank in agreement."""
    rank, n = init()
    first = Job("onebit_sgd", bucket_cap_mb=0.01)
    first.train(SAVE_AT)
    checkpoint = first.save()
    for cap in (1.0, 0.002):
        checkpoint.seek(0)
        resumed = Job("onebit_sgd", bucket_cap_mb=cap)
        resumed.load(checkpoint)
        records: list[logging.LogRecord] = []
        handler = logging.Handler()
        handler.emit = records.append  # type: ignore[method-assign]
        logging.getLogger("ddlcomm.hooks").addHandler(handler)
        try:
            resumed.train(4)
        finally:
            logging.getLogger("ddlcomm.hooks").removeHandler(handler)
        remaps = [r for r in records if "remapping" in r.getMessage()]
        assert len(remaps) == 1, f"cap {cap}: {len(remaps)} remap messages"
        layout = resumed.state.memory.layout
        assert layout != first.state.memory.layout and set(resumed.state.memory.worker_residuals) <= set(layout)
        assert torch.isfinite(_params(resumed.model)).all()
        _same_on_every_rank(_params(resumed.model), f"bucket_cap_mb {cap}")


if __name__ == "__main__":
    run()
