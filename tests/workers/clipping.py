"""Clipping the average gradient where the hook averages update directions (ddlcomm.clipping),
run on every rank by tests/test_clipping.py."""

from __future__ import annotations

import copy
import json
import math

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from common import init, run
from ddlcomm import clipping, compressors, hooks, optim

from compression import synthetic


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))


def _params(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def _relative_errors(numel: int, kind: str, trials: int, rank: int, world: int) -> list[float]:
    errors = []
    for trial in range(trials):
        g = torch.Generator().manual_seed(trial * 1000 + rank)
        x = torch.randn(numel, generator=g)
        if kind == "heavy":  # a few elements hold most of the energy
            x = x**3
        elif kind == "columns":  # a 256-wide matrix whose first columns are 30x the rest
            x = x.view(-1, 256) if numel % 256 == 0 else x.view(1, -1)
            x[:, :4] *= 30
            x = x.reshape(-1)
        elif kind == "one-signed":  # every element positive, as a bias's gradient can be
            x = x.abs() + 0.1
        exact = x.clone()
        dist.all_reduce(exact)
        exact = float(exact.norm()) / world
        parts = [x[: numel // 3], x[numel // 3:]]  # two buckets
        estimate, _ = clipping.sketched_norm(parts, trial, None, world)
        errors.append(float(estimate) / exact - 1)
    return errors


def sketch_estimates_the_norm(initialised: bool = False) -> None:
    """The sketched norm of the ranks' average against the exact one: exact where every element
    has a bin; elsewhere unbiased with a relative error of about sqrt(1 / (2k)) (the module's
    math), checked as RMS within 1.6x of it and every trial within 6x; the same on every rank."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if initialised else init()
    report = {}
    for numel in (300, 20_480, 1_048_576):
        bins = clipping.sketch_size(numel)
        sigma = math.sqrt(1 / (2 * bins))
        for kind in ("gaussian", "heavy", "columns", "one-signed"):
            errors = _relative_errors(numel, kind, 60 if numel < 100_000 else 24, rank, world)
            rms = math.sqrt(sum(e * e for e in errors) / len(errors))
            mean = sum(errors) / len(errors)
            report[f"{numel}/{kind}"] = {"bins": bins, "rms": rms, "mean": mean, "max": max(map(abs, errors))}
            if bins == numel:
                assert max(map(abs, errors)) < 1e-5, (numel, kind, errors)
                continue
            # The RMS of n draws is within 1/sqrt(2n) (relative) of sigma: 1.6x is over 3 of those at n = 24.
            assert rms <= 1.6 * sigma, (numel, kind, rms, sigma)
            assert max(map(abs, errors)) <= 6 * sigma, (numel, kind, errors)
            assert abs(mean) <= 4 * sigma / math.sqrt(len(errors)) + sigma**2, (numel, kind, mean, sigma)
            everyone = [None] * world
            dist.all_gather_object(everyone, errors)
            assert all(e == errors for e in everyone), "the ranks' estimates differ"
    if rank == 0:
        print("SKETCH " + json.dumps(report), flush=True)


def max_grad_norm_clips_the_average_gradient() -> None:
    """DDP with a lossy compressor, optimizer=ddlcomm.optim.SGD (no momentum: the direction is the
    gradient) and max_grad_norm at a twentieth of the first step's norm, against a reference that
    all-reduces every rank's own gradient: in the warm-up the hook's norm is the exact one and
    the step is the clipped average gradient; in compressed steps the norm is within the
    sketch's error, the step is about max_grad_norm long (unclipped it would be 20 times
    longer), and every rank holds the same parameters."""
    rank, world = init()
    x, y = synthetic(rank)
    start, steps = 3, 12
    report = {}
    for name, make in (("ternary", compressors.Ternary), ("onebit", compressors.OneBit)):
        model = _model()
        reference = copy.deepcopy(model)
        ddp = DistributedDataParallel(model, bucket_cap_mb=0.02)  # several buckets: the norm spans them
        opt = optim.SGD(model.parameters(), lr=1.0)
        state, clip, errors, lengths = None, 0.0, [], []
        for step in range(steps):
            idx = torch.randint(0, len(x), (32,), generator=torch.Generator().manual_seed(step * 97 + rank))
            reference.load_state_dict(model.state_dict())
            reference.zero_grad()
            torch.nn.functional.cross_entropy(reference(x[idx]), y[idx]).backward()
            average = torch.cat([p.grad.flatten() for p in reference.parameters()])
            dist.all_reduce(average)
            average /= world
            exact = float(average.norm())
            if state is None:
                clip = exact / 20
                state = hooks.CompressionState(None, make(), start_compress_iter=start, min_compression_bytes=0,
                                               optimizer=opt, max_grad_norm=clip)
                ddp.register_comm_hook(state, hooks.compressed_hook)
            before = _params(model)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(ddp(x[idx]), y[idx]).backward()
            opt.step()
            moved = before - _params(model)  # lr 1: the step taken
            if step < start:
                assert abs(float(state.grad_norm) / exact - 1) < 1e-5, (name, step, float(state.grad_norm), exact)
                expected = average * min(1.0, clip / (exact + clipping.EPS))
                assert torch.allclose(moved, expected, rtol=1e-4, atol=1e-6), (name, step)
            else:
                errors.append(float(state.grad_norm) / exact - 1)
                lengths.append(float(moved.norm()) / clip)
        everyone = [torch.empty_like(_params(model)) for _ in range(world)]
        dist.all_gather(everyone, _params(model))
        assert all(torch.equal(e, everyone[0]) for e in everyone), f"{name}: the replicas differ"
        sigma = math.sqrt(1 / (2 * clipping.sketch_size(before.numel())))
        assert max(map(abs, errors)) <= 6 * sigma, (name, errors, sigma)
        # Error feedback sends what earlier steps left behind too, so a step can be longer than
        # max_grad_norm; never near the 20x of an unclipped one.
        assert max(lengths) <= 1.5, (name, lengths)
        report[name] = {"norm_errors": errors, "step_lengths": lengths}
    if rank == 0:
        print("CLIPPED " + json.dumps(report), flush=True)


def sketch_and_clip() -> None:
    """Both, in one launch."""
    max_grad_norm_clips_the_average_gradient()
    sketch_estimates_the_norm(initialised=True)


if __name__ == "__main__":
    run()
