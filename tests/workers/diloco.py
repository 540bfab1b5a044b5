"""ddlcomm.diloco on every rank (tests/test_diloco.py): the outer step against a direct
implementation, error-feedback conservation across outer steps, bitwise-equal replicas, exact
resume, and the errors; two levels: diloco_levels.py."""

from __future__ import annotations

import io

import torch
import torch.distributed as dist

from common import init, run
from ddlcomm import compressors, optim
from ddlcomm.diloco import DiLoCo
from torch.nn.parallel import DistributedDataParallel

COMPRESSORS = {
    "none": lambda: None,
    "onebit": lambda: compressors.OneBit(block_size=64),
    "ternary": lambda: compressors.Ternary(block_size=64, stochastic=True, seed=3),
    "topk": lambda: compressors.TopK(ratio=0.05),
}


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.BatchNorm1d(64), torch.nn.ReLU(),
                               torch.nn.Linear(64, 4))


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(32, 16, generator=g)
    return x, (x[:, :4].sum(1) > 0).long() + (x[:, 4] > 0).long()


def inner_step(model: torch.nn.Module, opt: torch.optim.Optimizer, rank: int, step: int) -> None:
    x, y = batch(rank, step)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    opt.zero_grad()


def flat_state(model: torch.nn.Module) -> torch.Tensor:
    """The parameters and the buffers a checkpoint holds, flat."""
    return torch.cat([t.detach().reshape(-1).float() for t in model.state_dict().values() if t.is_floating_point()])


def assert_replicas_equal(model: torch.nn.Module, what: str) -> None:
    mine = flat_state(model)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    for r, other in enumerate(everyone):
        assert torch.equal(other, mine), f"{what}: rank {r}'s replica differs from rank {dist.get_rank()}'s"


def matches_reference(backend: str) -> None:
    """Float32 outer steps (compressor=None) equal DiLoCo written out with torch alone: the
    mean pseudo-gradient per parameter, torch's Nesterov SGD on float32 global weights, the
    replica set to them, BatchNorm's statistics averaged; a non-persistent buffer (a mask,
    different on each rank) left alone."""
    rank, n = init(backend)
    model, reference = make_model(), make_model()
    for m in (model, reference):
        m.register_buffer("mask", torch.tensor([float("-inf"), float(rank)]), persistent=False)
    inner = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ref_inner = torch.optim.AdamW(reference.parameters(), lr=3e-3)
    diloco = DiLoCo(model, inner, sync_every=5, outer_lr=0.7, outer_momentum=0.9)
    globals_ = [p.detach().clone() for p in reference.parameters()]
    outer = torch.optim.SGD(globals_, lr=0.7, momentum=0.9, nesterov=True)
    for step in range(20):
        inner_step(model, inner, rank, step)
        inner_step(reference, ref_inner, rank, step)
        synced = diloco.step()
        assert synced == ((step + 1) % 5 == 0)
        if synced:
            with torch.no_grad():
                for g, p in zip(globals_, reference.parameters()):
                    g.grad = g - p
                    dist.all_reduce(g.grad)
                    g.grad /= n
                outer.step()
                for g, p in zip(globals_, reference.parameters()):
                    p.copy_(g)
                for name, b in reference.named_buffers():
                    if b.is_floating_point() and name != "mask":
                        dist.all_reduce(b)
                        b /= n
            torch.testing.assert_close(flat_state(model), flat_state(reference), rtol=0, atol=0,
                                       msg=lambda m: f"outer step {diloco.outer_steps}: {m}")
            assert model.mask.tolist() == [float("-inf"), float(rank)], model.mask
            assert_replicas_equal(model, f"outer step {diloco.outer_steps}")
    assert diloco.outer_steps == 4 and diloco.inner_steps == 20
    # float32 every 5 steps: a fifth of what DDP sends in float32 at every step
    assert abs(diloco.stats.ratio - 5.0) < 1e-9, diloco.stats


def streaming_matches_reference(backend: str) -> None:
    """Streaming (2 fragments, every 4 steps, applied 1 step late), float32, against the schedule
    and the update written out with torch alone: fragment k sends at inner steps t with
    t % 4 == (k + 1) * 4 // 2 % 4, its average moves its global weights one step later, and the
    replica keeps what its inner step added meanwhile; BatchNorm's statistics are averaged when
    fragment 0 is sent and kept as they changed since. Global weights bitwise equal everywhere."""
    rank, n = init(backend)
    model, reference = make_model(), make_model()
    inner = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ref_inner = torch.optim.AdamW(reference.parameters(), lr=3e-3)
    diloco = DiLoCo(model, inner, sync_every=4, fragments=2, overlap_steps=1, outer_lr=0.7, outer_momentum=0.9)
    positions = {id(p): i for i, p in enumerate(model.parameters())}
    fragments = [[positions[id(p)] for p in part] for part in diloco.fragment_parameters]
    assert sorted(i for part in fragments for i in part) == list(range(len(positions))), fragments
    assert all(part == list(range(part[0], part[-1] + 1)) for part in fragments), f"not contiguous: {fragments}"
    params = list(reference.parameters())
    globals_ = [p.detach().clone() for p in params]
    outer = torch.optim.SGD(globals_, lr=0.7, momentum=0.9, nesterov=True)
    in_flight = []  # (fragment, due step, averages, the replica's parameters when sent, buffers' and theirs)
    buffers = [b for b in reference.buffers() if b.is_floating_point()]
    for step in range(17):
        t = step + 1
        inner_step(model, inner, rank, step)
        inner_step(reference, ref_inner, rank, step)
        applied = diloco.step()
        with torch.no_grad():
            due = [f for f in in_flight if f[1] <= t]
            in_flight = [f for f in in_flight if f[1] > t]
            for k, _, averages, sent, (buffer_average, buffers_sent) in due:
                for i, average in zip(fragments[k], averages):
                    globals_[i].grad = average
                outer.step()
                for i, before in zip(fragments[k], sent):
                    params[i].copy_(globals_[i] + (params[i] - before))
                    globals_[i].grad = None
                if k == 0:
                    kept = buffer_average + (torch.cat([b.reshape(-1) for b in buffers]) - buffers_sent)
                    for b, value in zip(buffers, kept.split([b.numel() for b in buffers])):
                        b.copy_(value.view_as(b))
            for k in range(2):
                if t % 4 == (k + 1) * 4 // 2 % 4:
                    averages = [globals_[i] - params[i] for i in fragments[k]]
                    for a in averages:
                        dist.all_reduce(a)
                        a /= n
                    sent_buffers = buffer_average = None
                    if k == 0:
                        sent_buffers = torch.cat([b.reshape(-1) for b in buffers])
                        buffer_average = sent_buffers.clone()
                        dist.all_reduce(buffer_average)
                        buffer_average /= n
                    in_flight.append((k, t + 1, averages, [params[i].clone() for i in fragments[k]],
                                      (buffer_average, sent_buffers)))
        assert applied == bool(due), (t, applied, due)
        torch.testing.assert_close(flat_state(model), flat_state(reference), rtol=0, atol=0, msg=lambda m: f"step {t}: {m}")
        _assert_globals_equal(diloco, f"step {t}")
    # Fragment 0 applied at steps 3, 7, 11, 15; fragment 1 at 5, 9, 13, 17.
    assert diloco.outer_steps == 8, diloco.outer_steps


def warmup_matches_ddp(backend: str) -> None:
    """warmup_steps=6 (float32), SGD with momentum and weight decay and AdamW, with and without
    an outer compressor: after each warm-up step every replica equals DDP's model (to float32
    rounding: DDP divides before it sums) and nothing was compressed (the residuals are zero);
    the outer optimizer stays untouched until the first outer step, at step 8 (sync_every=4);
    every warm-up step sends what DDP sends."""
    rank, n = init(backend)
    gloo = dist.new_group(backend="gloo")
    for name, optimizer in (("none", "sgd"), ("ternary", "sgd"), ("ternary", "adamw")):
        _warmup_matches_ddp(name, optimizer, rank, gloo)


def _warmup_matches_ddp(name: str, optimizer: str, rank: int, gloo: dist.ProcessGroup) -> None:
    def plain() -> torch.nn.Module:  # no BatchNorm: DDP broadcasts rank 0's statistics, DiLoCo averages them
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))

    model, reference = plain(), plain()
    if optimizer == "sgd":
        make = lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-3)  # noqa: E731
    else:
        make = lambda params: torch.optim.AdamW(params, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)  # noqa: E731
    name = f"{name}, {optimizer}"
    inner = make(model.parameters())
    ddp = DistributedDataParallel(reference, process_group=gloo)
    ddp_inner = make(reference.parameters())
    diloco = DiLoCo(model, inner, sync_every=4, warmup_steps=6, compressor=COMPRESSORS[name.split(",")[0]](),
                    outer_lr=0.7, outer_momentum=0.9)
    for step in range(10):
        t = step + 1
        inner_step(model, inner, rank, step)
        inner_step(ddp, ddp_inner, rank, step)
        assert diloco.step() == (t <= 6 or t % 4 == 0), t
        if t <= 6:
            torch.testing.assert_close(flat_state(model), flat_state(reference), rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{name}, warm-up step {t}: {m}")
            assert_replicas_equal(model, f"{name}, warm-up step {t}")
            assert not diloco.outer_optimizer.state, f"{name}: warm-up step {t} moved the outer optimizer"
            state = diloco.state_dict()
            for key in ("worker_residual", "server_residual"):
                assert state[key] is None or not state[key].any(), f"{name}: warm-up step {t} compressed ({key})"
    assert (diloco.outer_steps, diloco.inner_steps) == (1, 10), (diloco.outer_steps, diloco.inner_steps)
    if name.startswith("none"):  # 6 warm-up averages and 1 outer step, each DDP's bytes for one step
        assert abs(diloco.stats.ratio - 10 / 7) < 1e-9, diloco.stats


def _assert_globals_equal(diloco: DiLoCo, what: str) -> None:
    mine = torch.cat([g.reshape(-1) for g in diloco.state_dict()["globals"]])
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    assert all(torch.equal(other, mine) for other in everyone), f"{what}: the global weights differ between ranks"


def conservation(backend: str, names: str) -> None:
    """For each compressor of ``names`` (comma-separated): with outer_lr 1 and no momentum the
    global weights move by exactly the averaged pseudo-gradient A_t; error feedback loses nothing
    across outer steps: sum_t A_t = sum_t mean_r(D_t,r) + mean_r(w_0,r - w_T,r) + (s_0 - s_T), the
    server residuals laid out at the positions each rank reduces. D_t,r is computed here (float64,
    gloo)."""
    rank, n = init(backend)
    gloo = dist.new_group(backend="gloo")
    for name in names.split(","):
        _conservation(name, rank, n, gloo)


def _conservation(name: str, rank: int, n: int, gloo: dist.ProcessGroup) -> None:
    model = make_model()
    inner = torch.optim.SGD(model.parameters(), lr=0.05)
    diloco = DiLoCo(model, inner, sync_every=3, compressor=COMPRESSORS[name](), outer_lr=1.0, outer_momentum=0.0)
    params = lambda: torch.cat([p.detach().reshape(-1).double() for p in model.parameters()])  # noqa: E731
    start = diloco.state_dict()
    global_ = params()
    applied = torch.zeros_like(global_)
    true = torch.zeros_like(global_)
    for step in range(12):
        inner_step(model, inner, rank, step)
        if (step + 1) % 3 == 0:
            d = global_ - params()
            dist.all_reduce(d, group=gloo)
            true += d / n
        before = global_
        if diloco.step():
            global_ = params()
            applied += before - global_
    _assert_conserved(name, applied, true, start, diloco.state_dict(), "", gloo)


def _assert_conserved(name: str, applied: torch.Tensor, true: torch.Tensor, start: dict, end: dict, prefix: str,
                      gloo: dist.ProcessGroup) -> None:
    """sum_t A_t = sum_t mean_r(D_t,r) + mean_r(w_0,r - w_T,r) + (s_0 - s_T) with the
    ``prefix``-ed residuals of the states ``start`` and ``end``."""
    rank, n = dist.get_rank(), dist.get_world_size()
    worker = (start[prefix + "worker_residual"] - end[prefix + "worker_residual"]).double()
    dist.all_reduce(worker, group=gloo)
    expected = true + worker / n
    if end[prefix + "server_residual"] is not None:
        numel = true.numel()
        server = torch.zeros(numel, dtype=torch.float64)
        begin, stop = numel * rank // n, numel * (rank + 1) // n  # one piece: chunk `rank`
        server[begin:stop] = (start[prefix + "server_residual"] - end[prefix + "server_residual"]).double()
        dist.all_reduce(server, group=gloo)
        expected += server
    scale = float(true.abs().max()) + float(worker.abs().max()) / n
    torch.testing.assert_close(applied, expected, rtol=0, atol=1e-5 * scale,
                               msg=lambda m: f"{name} on {dist.get_backend()}: error feedback lost something: {m}")
    assert float((applied - true).abs().max()) > 1e-4 * scale or name == "none", "the compressor changed nothing?"


def warmup_conservation(backend: str, names: str) -> None:
    """A compressed warm-up (warmup_compressor=, 8 steps of SGD with momentum): the gradient
    each inner step takes is the same on every rank (so are the replicas and the momentum),
    and its error feedback loses nothing: sum_t A_t = sum_t mean_r(g_t,r) + the residuals'
    change, g_t,r this rank's own gradient, read here before the step. The outer residuals
    stay zero. "+directions": a ddlcomm.optim.SGD, whose update directions travel instead,
    d_t,r = 0.9 * buf + g_t,r with the momentum buffer every rank shares (computed here)."""
    rank, n = init(backend)
    gloo = dist.new_group(backend="gloo")
    for name in names.split(","):
        name, directions = name.removesuffix("+directions"), name.endswith("+directions")
        model = make_model()
        # No weight decay: p.grad stays A_t.
        inner = (optim.SGD if directions else torch.optim.SGD)(model.parameters(), lr=0.05, momentum=0.9)
        # 9 warm-up steps, 8 taken: the warm-up's residuals are freed when it ends.
        diloco = DiLoCo(model, inner, sync_every=100, warmup_steps=9, compressor=compressors.OneBit(),
                        warmup_compressor=COMPRESSORS[name]())
        flat = lambda ts: torch.cat([t.reshape(-1).double() for t in ts])  # noqa: E731
        start = diloco.state_dict()
        applied, true = 0, 0
        for step in range(8):
            x, y = batch(rank, step)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            mine = flat([p.grad for p in model.parameters()])
            if directions:
                mine += 0.9 * flat([inner.state[p].get("momentum_buffer", torch.zeros_like(p))
                                    for p in model.parameters()])
            dist.all_reduce(mine, group=gloo)
            true = true + mine / n
            inner.step()
            applied = applied + flat([p.grad for p in model.parameters()])
            inner.zero_grad()
            assert diloco.step()
            assert_replicas_equal(model, f"{name}, warm-up step {step + 1}")
            momentum = flat([inner.state[p]["momentum_buffer"] for p in model.parameters()])
            everyone = [torch.empty_like(momentum) for _ in range(n)]
            dist.all_gather(everyone, momentum, group=gloo)
            assert all(torch.equal(m, momentum) for m in everyone), f"{name}: the momentum differs between ranks"
        end = diloco.state_dict()
        _assert_conserved(name, applied, true, start, end, "warmup_", gloo)
        assert end["worker_residual"] is not None and not end["worker_residual"].any(), "the warm-up used the outer memory"
        assert not diloco.outer_optimizer.state and diloco.outer_steps == 0, "the warm-up took an outer step"


def resume(backend: str, names: str) -> None:
    """For each compressor of ``names`` (comma-separated): replicas bitwise equal after every
    outer step; a run saved between outer steps and resumed into new objects continues bit for
    bit as the uninterrupted one."""
    rank, _ = init(backend)
    for name in names.split(","):
        _resume(name, rank)


def _resume(name: str, rank: int) -> None:
    # "+stream": 2 fragments applied 1 step late; at step 9 fragment 0's average is in flight.
    # "+warmup": 6 steps of averaging, then outer steps at 8, 12 and 16; "+cwarmup": 12 steps
    # of compressed averaging (saved in the middle), then an outer step at 16.
    name, cwarmup = name.removesuffix("+cwarmup"), name.endswith("+cwarmup")
    name, warmup = name.removesuffix("+warmup"), name.endswith("+warmup")
    name, streaming = name.removesuffix("+stream"), name.endswith("+stream")
    options = {"fragments": 2, "overlap_steps": 1} if streaming else {}
    if warmup:
        options["warmup_steps"] = 6
    if cwarmup:
        options.update(warmup_steps=12, warmup_compressor=COMPRESSORS["ternary"]())

    def build() -> tuple[torch.nn.Module, torch.optim.Optimizer, DiLoCo]:
        model = make_model()
        inner = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
        return model, inner, DiLoCo(model, inner, sync_every=4, compressor=COMPRESSORS[name](), **options)

    model, inner, diloco = build()
    saved = ended = None
    for step in range(16):
        inner_step(model, inner, rank, step)
        if diloco.step():
            _assert_globals_equal(diloco, f"{name}, outer step {diloco.outer_steps}")
            if not streaming:
                assert_replicas_equal(model, f"{name}, outer step {diloco.outer_steps}")
        if cwarmup and diloco.inner_steps == diloco.warmup_steps:  # the warm-up's last step
            ended = diloco.state_dict()
        if step == 9:  # between outer steps: the replica differs from the global weights
            buffer = io.BytesIO()
            torch.save({"model": model.state_dict(), "inner": inner.state_dict(), "diloco": diloco.state_dict()}, buffer)
            saved = buffer.getvalue()
    uninterrupted = flat_state(model)
    if cwarmup:  # the warm-up's memory is freed when it ends, and a state saved then or after it loads
        for when, after in (("at its last step", ended), ("after it", diloco.state_dict())):
            assert after["warmup_worker_residual"] is None and after["warmup_server_residual"] is None, when
            fresh = build()[2]
            fresh.load_state_dict(after)
            assert fresh.state_dict()["warmup_worker_residual"] is None, f"a state saved {when} kept its memory"
    model, inner, diloco = build()
    state = torch.load(io.BytesIO(saved), weights_only=True)
    model.load_state_dict(state["model"])
    inner.load_state_dict(state["inner"])
    diloco.load_state_dict(state["diloco"])
    for step in range(10, 16):
        inner_step(model, inner, rank, step)
        diloco.step()
    assert torch.equal(flat_state(model), uninterrupted), f"{name}: the resumed run differs from the uninterrupted one"
    assert diloco.outer_steps == (7 if streaming else 3 if warmup else 1 if cwarmup else 4), diloco.outer_steps


def errors() -> None:
    """Bad arguments and states are refused with the reason; a non-finite pseudo-gradient on
    one rank raises on every rank and leaves the global weights alone."""
    rank, n = init()
    model = make_model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    for bad, kind, text in ((dict(sync_every=0), ValueError, "sync_every"),
                            (dict(compressor="onebit"), TypeError, "compressor"),
                            (dict(sync_every=4, overlap_steps=4), ValueError, "overlap_steps (4) must be less than"),
                            (dict(fragments=7), ValueError, "7 fragments for 6 parameters"),
                            (dict(fragments=True), ValueError, "fragments must be an integer"),
                            (dict(warmup_steps=-1), ValueError, "warmup_steps must be an integer >= 0"),
                            (dict(warmup_steps=2, warmup_compressor="ternary"), TypeError, "warmup_compressor")):
        try:
            DiLoCo(model, inner, **bad)
        except kind as e:
            assert text in str(e), e
        else:
            raise AssertionError(f"{bad} was accepted")
    warm = DiLoCo(model, inner, warmup_steps=2)
    for _ in range(2):  # no rank runs inner_optimizer.step(): no rank takes the step (the hook goes after 2)
        assert not warm.step()
    assert warm.skipped_warmup_steps == 2
    diloco = DiLoCo(model, inner, sync_every=2, compressor=compressors.OneBit())
    state = diloco.state_dict()
    other = DiLoCo(model, inner, sync_every=3, compressor=compressors.OneBit())
    try:
        other.load_state_dict(state)
    except ValueError as e:
        assert "sync_every" in str(e), e
    else:
        raise AssertionError("a state of another schedule was loaded")
    before = flat_state(model)
    if rank == n - 1:
        with torch.no_grad():
            next(model.parameters())[0, 0] = float("nan")
    try:
        diloco.sync()
    except RuntimeError as e:
        assert "not finite" in str(e) and f"rank {rank}" in str(e), e
    else:
        raise AssertionError("a non-finite pseudo-gradient was applied")
    if rank != n - 1:
        assert torch.equal(flat_state(model), before), "the replica moved after a refused outer step"


def warmup_skip(backend: str) -> None:
    """A GradScaler that finds inf on the last rank skips warm-up step 2 there: no rank takes
    it (the others' AdamW drops its gradients), so the replicas and the global weights stay
    bitwise equal through the warm-up and the other steps train on the average."""
    rank, n = init(backend)
    model = make_model()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    diloco = DiLoCo(model, inner, sync_every=4, warmup_steps=3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 4)
    for step in range(1, 4):
        x, y = batch(rank, step)
        inner.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        if step == 2 and rank == n - 1:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        weights = lambda: torch.cat([p.detach().reshape(-1) for p in model.parameters()])  # noqa: E731
        before = weights()
        scaler.step(inner)
        scaler.update()
        assert diloco.step() == (step != 2), step
        assert torch.equal(weights(), before) == (step == 2), f"step {step}: taken {step != 2} here"
        assert_replicas_equal(model, f"warm-up step {step}")
        _assert_globals_equal(diloco, f"warm-up step {step}")
    assert diloco.skipped_warmup_steps == 1
    steps = torch.tensor([float(inner.state[p]["step"]) for p in model.parameters()])
    assert torch.all(steps == 2), steps  # AdamW stepped twice on every rank


if __name__ == "__main__":
    run()
