"""Adaptive compression per bucket (ddlcomm.adaptive), run on every rank by tests/test_adaptive.py."""

from __future__ import annotations

import io
import logging

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from common import ddlcomm_stats, init, run
from compression import flat_params, small_model, synthetic, train_step
from ddlcomm import compressors, hooks, optim
from ddlcomm.adaptive import Tuner
from ddlcomm.compressed import two_levels
from ddlcomm.ddp_memory import FeedbackMemory


class Bucket:
    """A DDP bucket double: one flat buffer, keyed by its index."""

    def __init__(self, buffer: torch.Tensor, index: int, last: bool) -> None:
        self._buffer, self._index, self._last = buffer, index, last

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return self._last

    def parameters(self) -> list:
        return []


def _same_everywhere(value: torch.Tensor, group=None) -> bool:
    everyone = [torch.empty_like(value) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, value, group=group)
    return all(torch.equal(e, value) for e in everyone)


def choice_rule() -> None:
    """The slowest rank's median decides, and the least lossy option within 10% of the fastest
    wins; on a group of two levels over hosts the compressor in one level is an option too."""
    rank, n = init("gloo")
    onebit = repr(compressors.OneBit())
    tuner = Tuner(compressors.OneBit(), 2)
    assert [tuner.name(i) for i in range(4)] == ["exact", "BF16()", onebit, f"{onebit} one level"]
    tuner.bind(False)  # one level is the compressor's own plan: no option of its own
    assert [tuner.name(i) for i in range(len(tuner.options))] == ["exact", "BF16()", onebit]
    bf16 = Tuner(compressors.BF16(), start=2)
    bf16.bind(True)
    assert [bf16.name(i) for i in range(len(bf16.options))] == ["exact", "BF16()", "BF16() one level"]  # none twice
    cases = [  # this rank's seconds per option (exact, bf16, 1-bit[, 1-bit one level]) -> the choice
        ([1.0, 0.97, 0.5], 2),
        ([1.0, 0.97, 0.5 if rank == 0 else 2.0], 0),  # rank 1 finds 1-bit slow: the slowest rank decides
        ([1.0, 0.85, 0.8], 1),  # bf16 within 10% of 1-bit, exact not
        ([1.0, 0.95, 0.92], 0),
        ([1.0, 0.9, 0.7, 0.5], 3),  # one level faster than two by more than 10%
        ([1.0, 0.9, 0.5, 0.47], 2),  # two levels (less lossy) within 10% of one
    ]
    for seconds, expected in cases:
        tuner = Tuner(compressors.OneBit(), start=2)
        tuner.bind(len(seconds) == 4)
        k = len(seconds)
        assert tuner.length == tuner.SETTLE + 2 * k * (1 + tuner.TRIALS)
        sent = []
        for it in range(2, 2 + tuner.length):
            assert tuner.measuring(it) and not tuner.settled(it)
            option = tuner.options.index(tuner.option(it))
            sent.append(option)
            block, step = divmod(it - 2 - tuner.SETTLE, 1 + tuner.TRIALS)
            # The settling and switching iterations take 100 s: ignored; so is one slow trial of each.
            noise = 100.0 if block < 0 or step == 0 else [1.5, 1.02][step - 1] if block < k else [1.0, 1.02][step - 1]
            if it == 1 + tuner.length:  # asking for the next iteration's option before the last record
                assert tuner.option(it + 1) == tuner.options[2]
            tuner.record(it, seconds[option] * noise, None, torch.device("cpu"))
        # Settling with the compressor (the group's plan), then two blocks each, from the lossiest and back.
        there = list(range(k - 1, -1, -1))
        assert sent == [2] * tuner.SETTLE + sum(([o] * (1 + tuner.TRIALS) for o in there + there[::-1]), []), sent
        assert tuner.settled(2 + tuner.length) and tuner.choice == expected, (seconds, tuner.measured)
        assert tuner.window == 2 + tuner.PERIOD and tuner.measuring(2 + tuner.PERIOD)
        # The next measurement settles with the choice.
        assert tuner.option(2 + tuner.PERIOD) == tuner.options[expected]
    saved = tuner.state_dict()
    other = Tuner(compressors.OneBit(), start=2)
    other.load_state_dict(saved)
    other.bind(True)
    assert other.choice == tuner.choice and other.window == tuner.window
    # A choice of one level loaded where the group takes one level anyway: the compressor.
    one_level = Tuner(compressors.OneBit(), start=2)
    one_level.load_state_dict({"choice": f"{onebit} one level", "window": 3})
    one_level.bind(False)
    assert one_level.name(one_level.choice) == onebit
    # Without a choice (a state saved without one): the compressor, and a measurement next.
    fresh = Tuner(compressors.OneBit(), start=2)
    fresh.bind(True)
    assert fresh.option(50).compressor == compressors.OneBit() and not fresh.option(50).flat
    assert fresh.window == 51 and fresh.measuring(51)
    try:
        Tuner(compressors.Ternary(), start=2).load_state_dict({"choice": repr(compressors.OneBit()), "window": 3})
    except ValueError as error:
        assert "not among this state's options" in str(error)
    else:
        raise AssertionError("the choice of another compressor was loaded")


def per_bucket_plan() -> None:
    """The cost model: fitted per option to the buckets' own times (a bucket issued before the
    previous one arrived counts from that arrival), it picks per bucket the least lossy option
    within 10% of the fastest; a plan that mixes options is tried on whole steps after the
    options and chosen only where it beats every option by 10%. A uniform plan is not tried.
    The plan comes back from a state dict."""
    rank, n = init("gloo")
    sizes = [65536, 16 << 20]
    # The transfers' seconds per option: exact 1 ms + 10 ns/B, bf16 1 ms + 5 ns/B, 1-bit 5 ms + 0.5 ns/B
    # (rank 1's bf16 slower: the slowest rank's median counts) -> bf16 for 64 KiB, 1-bit for 16 MiB.
    links = [(1e-3, 10e-9), (1e-3, (5.2 if rank == 1 else 5.0) * 1e-9), (5e-3, 0.5e-9)]
    cases = [  # (whole-step seconds per option and of the plan, the plan's links or None) -> choice
        ([1.0, 0.8, 0.6, 0.53], links, Tuner.PER_BUCKET),
        ([1.0, 0.8, 0.6, 0.56], links, 2),  # 1-bit within 10% of the plan: a single option wins
        ([1.0, 0.8, 0.6, 0.9], links, 2),
        ([1.0, 0.8, 0.6, None], [(0, 10e-9), (0, 6e-9), (0, 0.5e-9)], 2),  # 1-bit for both: no plan to try
    ]
    for seconds, model, expected in cases:
        tuner = Tuner(compressors.OneBit(), start=2)
        tuner.bind(False)
        it, sent = 2, []
        while tuner.measuring(it) or it == 2:
            option = tuner.options.index(tuner.option(it, 0)) if tuner.option(it, 0) == tuner.option(it, 1) else -1
            sent.append(option)
            if tuner.timed(it):
                alpha, beta = model[option]
                done = 0.0
                for b, size in enumerate(sizes):  # both issued at 0: the second waits for the first
                    done += alpha + beta * size
                    tuner.transferred(it, b, size, 0.0, done)
            tuner.record(it, seconds[option] * (1.2 if it % 3 == 0 else 1.0), None, torch.device("cpu"))
            it += 1
        mixed = seconds[-1] is not None
        assert tuner.choice == expected, (seconds, tuner.measured, tuner.buckets, tuner.costs)
        order = [2, 1, 0, 0, 1, 2] + ([-1, -1] if mixed else [])
        assert len(tuner.measured) == (4 if mixed else 3) and it == 2 + tuner.SETTLE + len(order) * 3
        assert sent[tuner.SETTLE:] == sum(([o] * 3 for o in order), []), sent
        if mixed:
            assert tuner.buckets == [1, 2], tuner.buckets
            for o, (alpha, beta) in enumerate(links):
                worst = 5.2e-9 if o == 1 else beta
                assert abs(tuner.costs[o][0] - alpha) < 1e-9 and abs(tuner.costs[o][1] - worst) < 1e-15, tuner.costs
    saved = Tuner(compressors.OneBit(), start=2)
    saved.choice, saved.buckets = Tuner.PER_BUCKET, [1, 2, 0]
    assert saved.name(saved.choice) == f"per bucket [BF16(), {repr(compressors.OneBit())}, exact]"
    loaded = Tuner(compressors.OneBit(), start=2)
    loaded.load_state_dict(saved.state_dict())
    loaded.bind(True)
    assert loaded.choice == Tuner.PER_BUCKET and loaded.buckets == [1, 2, 0]
    assert [loaded.option(5000, b) for b in range(4)] == [loaded.options[o] for o in (1, 2, 0, 2)]
    try:
        Tuner(compressors.Ternary(), start=2).load_state_dict(saved.state_dict())
    except ValueError as error:
        assert "not among this state's options" in str(error)
    else:
        raise AssertionError("a plan of another compressor was loaded")


def nothing_is_lost() -> None:
    """Through the measurement (1-bit in one level where the group takes two, 1-bit, bf16 and
    exact in turn, residuals carried across) and a last iteration sent exactly, the results add
    up to the inputs' average: an exact send, or one by the other plan, carries the worker and
    server residuals whole. Ranks agree bitwise on every result. The memory goes through its
    state dict after the last one-level iteration: which plan made it must come back with it."""
    rank, n = init()
    for group in (None, dist.new_group(backend="gloo")):
        state = hooks.CompressionState(group, compressors.OneBit(), start_compress_iter=2, min_compression_bytes=0,
                                       adaptive=True)
        numels = [5000, 300_000]
        total_in = [torch.zeros(m, dtype=torch.float64) for m in numels]
        total_out = [torch.zeros(m, dtype=torch.float64) for m in numels]
        reloaded, step, steps = False, 0, None
        while steps is None or step < steps:
            if steps is None and step > 2 and state.tuner.settled(state.iter):
                steps = step + 4  # then each bucket its own option, in turn, and the last one exact
            if steps is not None:
                state.tuner.choice = 0 if step == steps - 1 else Tuner.PER_BUCKET
                state.tuner.buckets = [[1, 2], [2, 0], [0, 1]][step % 3]
            futures, counted = [], (state.stats.compressed_buckets, state.stats.uncompressed_buckets)
            for i, m in enumerate(numels):
                grad = torch.randn(m, generator=torch.Generator().manual_seed(1000 * step + 10 * rank + i)) * (i + 1)
                everyone = [torch.randn(m, generator=torch.Generator().manual_seed(1000 * step + 10 * r + i)) * (i + 1)
                            for r in range(n)]
                total_in[i] += torch.stack(everyone).double().mean(0)
                futures.append(hooks.compressed_hook(state, Bucket(grad, i, i == len(numels) - 1)))
            for i, fut in enumerate(futures):
                out = fut.wait()
                assert _same_everywhere(out), f"step {step} bucket {i}: ranks disagree"
                total_out[i] += out.double()
            if steps is not None and step < steps - 1:  # each bucket went its own way (exact: not compressed)
                exact = state.tuner.buckets.count(0)
                assert (state.stats.compressed_buckets - counted[0], state.stats.uncompressed_buckets - counted[1]) \
                    == (2 - exact, exact), (step, state.tuner.buckets, state.stats)
            if state.memory.flat and not state.tuner.option(state.iter).flat and not reloaded:
                memory, reloaded = FeedbackMemory(), True
                memory.load_state_dict(state.memory.state_dict())
                state.memory = memory
            step += 1
        assert state.stats.compressed_buckets > 0
        assert len(state.tuner.options) == (4 if two_levels(group) else 3)  # one level tried where two are taken
        assert reloaded == two_levels(group)
        if group is None and ddlcomm_stats()["topology"] == "2 hosts x 2 ranks":
            assert ddlcomm_stats()["hierarchical_compressed_allreduces"] > 0
        for i in range(len(numels)):
            worst = float((total_out[i] - total_in[i]).abs().max())
            scale = float(total_in[i].abs().max())
            assert worst < 1e-5 * scale * steps, f"bucket {i}: {worst} lost of {scale} (group {group})"
        assert all(float(r.abs().max()) == 0 for r in state.memory.worker_residuals.values())
        assert all(float(r.abs().max()) == 0 for r in state.memory.server_residuals.values())


def trains_alike_everywhere() -> None:
    """DDP with the adaptive hook on a ddlcomm and a gloo group, with and without optimizer= (and
    its max_grad_norm, whose sketched norm runs around the measured iterations): every rank
    holds the same parameters and the same choices, the choice is logged, and the choices come
    back from a checkpoint."""
    rank, n = init()
    gloo = dist.new_group(backend="gloo")
    x, y = synthetic(rank)
    log = io.StringIO()
    handler = logging.StreamHandler(log)
    logging.getLogger("ddlcomm.hooks").addHandler(handler)
    logging.getLogger("ddlcomm.hooks").setLevel(logging.INFO)
    for group in (None, gloo):
        for directions in (False, True):
            model = small_model()
            opt = (optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.01) if directions
                   else torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
            ddp = DistributedDataParallel(model, process_group=group, bucket_cap_mb=0.02)
            state = hooks.CompressionState(group, compressors.Ternary(block_size=64), start_compress_iter=2,
                                           min_compression_bytes=0, adaptive=True,
                                           optimizer=opt if directions else None, model=model,
                                           max_grad_norm=1.0 if directions else None)
            ddp.register_comm_hook(state, hooks.compressed_hook)
            step = 0
            while not state.tuner.settled(state.iter) or step < 14:
                train_step(ddp, opt, x, y, step, rank)
                step += 1
            params = flat_params(model)
            assert torch.isfinite(params).all()
            assert _same_everywhere(params, gloo), "ranks hold different parameters"
            assert _same_everywhere(torch.tensor(state.tuner.measured), gloo), "ranks measured differently"
            # The cost model saw every bucket's transfers (all compressed here) and proposed the same plan everywhere.
            assert state.tuner.buckets and state.tuner.costs, (state.tuner.buckets, state.tuner.costs)
            assert all(c is not None and c[0] >= 0 and c[1] >= 0 for c in state.tuner.costs), state.tuner.costs
            assert _same_everywhere(torch.tensor(state.tuner.buckets), gloo), "ranks planned differently"
            saved = state.state_dict()
            fresh = hooks.CompressionState(group, compressors.Ternary(block_size=64), start_compress_iter=2,
                                           adaptive=True, model=model)
            fresh.load_state_dict(saved)
            assert fresh.tuner.choice == state.tuner.choice and fresh.tuner.window == state.tuner.window
    logging.getLogger("ddlcomm.hooks").removeHandler(handler)
    assert "adaptive choice" in log.getvalue(), log.getvalue()


def misuse_is_refused() -> None:
    init("gloo")
    try:
        hooks.CompressionState(None, compressors.TopK(ratio=0.01), adaptive=True, momentum=0.9)
    except ValueError as error:
        assert "use optimizer= instead" in str(error)
    else:
        raise AssertionError("adaptive with DGC momentum was accepted")


if __name__ == "__main__":
    run()
