"""FSDP2's optimizer moments moved into the communication (``ddlcomm.fsdp``'s ``momentum=`` and
``adam_betas=``), checked on every rank of a shard group (and its replicas, for HSDP); run by
tests/workers/sharded.py's scenarios."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ddlcomm import compressors, fsdp


def on_the_device(group: dist.ProcessGroup, replicate_group=None) -> None:
    """The same checks with the decisions a GPU makes on the device (masks, never read on the
    host), forced on these CPU tensors."""
    host = fsdp.device_finite
    fsdp.device_finite = lambda tensor: torch.isfinite(tensor).all()
    try:
        momentum_math(group, replicate_group)
        adam_math(group, replicate_group)
        non_finite_averages(group, replicate_group)
    finally:
        fsdp.device_finite = host


def momentum_math(group: dist.ProcessGroup, replicate_group=None) -> None:
    """``momentum=``: the averaged momentum is the momentum of the average over every rank
    (within fp16's error), the same bytes on every rank, and the output is its chunk (times
    the group size for SUM); with 1-bit too, every rank holds the same momentum."""
    n, r = group.size(), group.rank()
    rank, world = dist.get_rank(), dist.get_world_size()
    m, beta = 1000, 0.9
    g = torch.Generator().manual_seed(100 + rank)
    for compressor in (compressors.FP16(), compressors.OneBit(block_size=32)):
        state = fsdp.FSDPCompressionState(compressor, start_compress_iter=1, min_compression_bytes=0,
                                          replicate_group=replicate_group, momentum=beta)
        reference = torch.zeros(n * m, dtype=torch.float64)
        for step, op in enumerate((dist.ReduceOp.AVG, dist.ReduceOp.SUM, dist.ReduceOp.AVG)):
            x = torch.randn(n * m, generator=g)
            total = x.double()
            dist.all_reduce(total)  # every rank of every replica
            reference = beta * reference + total / world
            out = torch.empty(m)
            state.reduce_scatter("layer", out, x, group, op)
            state.replica_all_reduce("layer", out)  # a no-op with momentum: done above
            buf = state.momenta["layer"]
            chunk = buf[r * m:(r + 1) * m] * (n if op == dist.ReduceOp.SUM else 1)
            assert torch.equal(out, chunk), f"step {step}: the output is not the momentum's chunk"
            everyone = [torch.empty_like(buf) for _ in range(world)]
            dist.all_gather(everyone, buf)
            assert all(torch.equal(b, buf) for b in everyone), f"{compressor}: ranks hold different momenta"
            if isinstance(compressor, compressors.FP16):
                err = (buf.double() - reference).abs().max()
                assert err < 2e-2, f"step {step}: {err}"  # fp16 rounding of values up to ~10
        assert state.stats.compressed_buckets == 2 and state.stats.uncompressed_buckets == 1, vars(state.stats)
        assert state.server_residuals and (replicate_group is None) == (not state.replica_residuals)
        before = state.momenta["layer"].clone()
        x = torch.randn(n * m, generator=g)
        if rank == world - 1:
            x[5::m] = float("inf")  # in every rank's chunk
        state.reduce_scatter("layer", out, x, group, dist.ReduceOp.AVG)
        assert not torch.isfinite(out).any(), "an inf gradient on one rank left some of this rank's output finite"
        assert torch.equal(state.momenta["layer"], before), "an inf gradient on one rank changed the momentum"
    try:
        state.reduce_scatter("layer", torch.empty(m), torch.randn(n * m), group, dist.ReduceOp.MAX)
    except ValueError as e:
        assert "SUM or AVG" in str(e), e
    else:
        raise AssertionError("momentum with MAX was accepted")


def non_finite_averages(group: dist.ProcessGroup, replicate_group=None) -> None:
    """``momentum=`` and ``adam_betas=``, every compressor, compressed and uncompressed: one
    NaN (or, through fp16, a finite value that overflows it) in one chunk of the last rank
    makes every output of every rank NaN, leaves every rank's moments as they were and clears
    the residuals; the next step is finite again and the moments stay alike."""
    n, r = group.size(), group.rank()
    rank, world = dist.get_rank(), dist.get_world_size()
    m = 512
    g = torch.Generator().manual_seed(300 + rank)
    kinds = {"fp16": compressors.FP16, "1-bit": lambda: compressors.OneBit(block_size=32),
             "ternary": lambda: compressors.Ternary(block_size=64), "top-k": lambda: compressors.TopK(ratio=0.05),
             "random-k": lambda: compressors.RandomK(ratio=0.1)}
    cases = [(kind, options, start, bad) for kind in kinds for options in ({"momentum": 0.9}, {"adam_betas": (0.9, 0.99)})
             for start, bad in ((1, float("nan")), (9, float("inf")))] + [("fp16", {"momentum": 0.9}, 1, 1e6)]
    for kind, options, start, bad in cases:
        state = fsdp.FSDPCompressionState(kinds[kind](), start_compress_iter=start, min_compression_bytes=0,
                                          replicate_group=replicate_group, **options)
        name = f"{kind} {options} from {start}, {bad}"
        moments = state.exp_avgs if "adam_betas" in options else state.momenta
        out = torch.empty(m)
        for _ in range(2):
            state.reduce_scatter("layer", out, torch.randn(n * m, generator=g), group, dist.ReduceOp.AVG)
        before = moments["layer"].clone()
        x = torch.randn(n * m, generator=g)
        if rank == world - 1:
            x[(n - 1) * m + 7] = bad  # in the last chunk only
        state.reduce_scatter("layer", out, x, group, dist.ReduceOp.AVG)
        assert out.isnan().all(), f"{name}: {int((~out.isnan()).sum())} outputs are not NaN"
        if replicate_group is not None:  # a sparse compressor sends some of the NaNs: the sum is NaN there
            state.replica_all_reduce("layer", out)
            assert not torch.isfinite(out).all(), f"{name}: the replicas' average is finite"
        assert torch.equal(moments["layer"], before), f"{name}: the moment changed"
        for kind_of in ("residuals", "server_residuals", "replica_residuals", "replica_server_residuals"):
            residual = getattr(state, kind_of).get("layer")
            assert residual is None or start > 2 or not residual.any(), f"{name}: {kind_of} not cleared"
        state.reduce_scatter("layer", out, torch.randn(n * m, generator=g), group, dist.ReduceOp.AVG)
        assert torch.isfinite(out).all() and torch.isfinite(moments["layer"]).all(), f"{name}: not finite again"
        everyone = [torch.empty_like(moments["layer"]) for _ in range(n)]
        dist.all_gather(everyone, moments["layer"], group=group)
        assert all(torch.equal(e, moments["layer"]) for e in everyone), f"{name}: ranks hold different moments"


def adam_math(group: dist.ProcessGroup, replicate_group=None) -> None:
    """``adam_betas=``: the first moment is the moment of the group's average gradient (within
    fp16's error) and the same bytes on every rank of the group; the output is the chunk's Adam
    step with the second moment of this rank's own gradient (of the average where uncompressed;
    at most 1 per element; times the group size for SUM),
    averaged over the replicas and then the same on each. A non-finite gradient on one rank
    makes every output non-finite and leaves every rank's moments as they were."""
    n, r = group.size(), group.rank()
    rank = dist.get_rank()
    m, (beta1, beta2), eps = 1000, (0.9, 0.99), 1e-8
    g = torch.Generator().manual_seed(200 + rank)
    state = fsdp.FSDPCompressionState(compressors.FP16(), start_compress_iter=1, min_compression_bytes=0,
                                      replicate_group=replicate_group, adam_betas=(beta1, beta2), adam_eps=eps)
    first = torch.zeros(n * m, dtype=torch.float64)
    second = torch.zeros(m, dtype=torch.float64)
    for step, op in enumerate((dist.ReduceOp.AVG, dist.ReduceOp.SUM, dist.ReduceOp.AVG), start=1):
        x = torch.randn(n * m, generator=g) * (rank + 1)  # ranks' gradients differ in scale
        average = x.double()
        dist.all_reduce(average, group=group)
        first = beta1 * first + (1 - beta1) * average / n
        # The first call is uncompressed (start_compress_iter=1): AdamW on the average gradient.
        mine = (average / n if step == 1 else x.double())[r * m:(r + 1) * m]
        second = beta2 * second + (1 - beta2) * mine**2
        first_hat = first[r * m:(r + 1) * m] / (1 - beta1**step)
        denom = torch.maximum((second / (1 - beta2**step)).sqrt(), first_hat.abs()) + eps  # |step| <= 1
        expected = first_hat / denom * (n if op == dist.ReduceOp.SUM else 1)
        out = torch.empty(m)
        state.reduce_scatter("layer", out, x, group, op)
        # In the moment's units (fp16 rounding of values up to ~5), not the step's: a small
        # second moment magnifies the moment's rounding.
        err = ((out.double() - expected) * denom).abs().max() / (n if op == dist.ReduceOp.SUM else 1)
        assert err < 1e-2, f"step {step}: {err}"
        moment = state.exp_avgs["layer"]
        everyone = [torch.empty_like(moment) for _ in range(n)]
        dist.all_gather(everyone, moment, group=group)
        assert all(torch.equal(e, moment) for e in everyone), f"step {step}: ranks hold different first moments"
        if replicate_group is not None:
            before = out.clone()
            state.replica_all_reduce("layer", out)
            mean = before.double()
            dist.all_reduce(mean, group=replicate_group)
            mean /= replicate_group.size()
            assert (out.double() - mean).abs().max() < 1e-2 * mean.abs().max(), f"step {step}: replica average"
            outs = [torch.empty_like(out) for _ in range(replicate_group.size())]
            dist.all_gather(outs, out, group=replicate_group)
            assert all(torch.equal(o, out) for o in outs), f"step {step}: replicas' steps differ"
    moments = state.exp_avgs["layer"].clone(), state.exp_avg_sqs["layer"].clone()
    x = torch.randn(n * m, generator=g)
    if rank == dist.get_world_size() - 1:
        x[7::m] = float("nan")  # in every rank's chunk
    out = torch.empty(m)
    state.reduce_scatter("layer", out, x, group, dist.ReduceOp.AVG)
    if replicate_group is not None:
        state.replica_all_reduce("layer", out)
    assert not torch.isfinite(out).any(), "a NaN gradient on one rank left some of this rank's output finite"
    assert torch.equal(state.exp_avgs["layer"], moments[0]) and torch.equal(state.exp_avg_sqs["layer"], moments[1]), \
        "a NaN gradient on one rank changed this rank's moments"
    try:
        fsdp.FSDPCompressionState(compressors.FP16(), momentum=0.9, adam_betas=(0.9, 0.999))
    except ValueError as e:
        assert "exclude" in str(e), e
    else:
        raise AssertionError("momentum= and adam_betas= together were accepted")
