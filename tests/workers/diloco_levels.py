"""ddlcomm.diloco over two levels (tests/test_diloco.py): replicas of several ranks each, DDP
inside a replica and outer steps across them, each rank syncing its part."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from common import init, run
from ddlcomm.compressed import wire_bytes
from ddlcomm.diloco import DiLoCo
from ddlcomm.replicas import replica_groups
from ddlcomm.wire import ring_all_reduce_bytes
from diloco import COMPRESSORS, assert_replicas_equal, flat_state, inner_step, make_model


def two_levels(backend: str) -> None:
    """4 ranks as 2 replicas of 2 (DDP inside each, as inside a host): float32 outer steps
    equal the mean over the replicas of the pseudo-gradient (outer SGD without momentum,
    written out here), each rank syncing half of it; then ternary. Every rank ends each outer
    step on the same parameters, sends half the bytes of a replica of one rank (float32), and a group
    that mixes indices is refused."""
    rank, n = init(backend)
    replica, outer = replica_groups(2)
    for name in ("none", "ternary"):
        # Float32: BatchNorm's running statistics stay out of the comparison (eval). Ternary:
        # they differ inside a replica (each rank's own batch statistics, not broadcast) and
        # must still come out of an outer step equal everywhere.
        model = make_model().eval() if name == "none" else make_model()
        ddp = DistributedDataParallel(model, process_group=replica, forward_sync_buffers=name == "none")
        inner = torch.optim.SGD(model.parameters(), lr=0.05)
        diloco = DiLoCo(model, inner, sync_every=3, compressor=COMPRESSORS[name](), outer_lr=0.7,
                        outer_momentum=0.0, process_group=outer, replica_group=replica)
        for step in range(9):
            inner_step(ddp, inner, rank // 2 if name == "none" else rank, step)  # float32: a batch per replica
            params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            globals_ = torch.cat([g.reshape(-1) for g in diloco._globals]) if step % 3 == 2 else None
            locals_ = [torch.empty_like(params) for _ in range(n)]
            dist.all_gather(locals_, params)
            assert torch.equal(locals_[rank ^ 1], params), f"{name} step {step}: the replica's ranks differ"
            if diloco.step():
                assert_replicas_equal(model, f"{name}, outer step at {step}")
                if name == "none":
                    mean = ((globals_ - locals_[0]) + (globals_ - locals_[2])) / 2
                    expected = globals_ - 0.7 * mean
                    got = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
                    assert torch.allclose(got, expected, rtol=0, atol=1e-6), (step, (got - expected).abs().max())
        numel = sum(p.numel() for p in model.parameters())
        whole = ring_bytes(numel, name)  # a replica of one rank sends the whole model
        if name == "none":
            assert diloco.stats.bytes_sent * 2 == whole, (name, diloco.stats.bytes_sent, whole)
        else:  # half the elements; the payloads' headers and scales do not halve on so small a model
            assert diloco.stats.bytes_sent < 0.75 * whole, (name, diloco.stats.bytes_sent, whole)
    # A float32 warm-up: each rank averages its half of the replica's gradient across the
    # replicas, so the 4 ranks train as DDP over all of them (BatchNorm in eval: its
    # statistics stay out of it).
    gloo = dist.new_group(backend="gloo")
    model, reference = make_model().eval(), make_model().eval()
    inner = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ref_inner = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    diloco = DiLoCo(model, inner, sync_every=3, warmup_steps=3, process_group=outer, replica_group=replica)
    ddp, world_ddp = (DistributedDataParallel(model, process_group=replica),
                      DistributedDataParallel(reference, process_group=gloo))
    for step in range(3):
        inner_step(ddp, inner, rank, step)
        inner_step(world_ddp, ref_inner, rank, step)
        assert diloco.step()
        torch.testing.assert_close(flat_state(model), flat_state(reference), rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"two levels, warm-up step {step + 1}: {m}")
        assert_replicas_equal(model, f"two levels, warm-up step {step + 1}")
    try:
        DiLoCo(make_model(), torch.optim.SGD(make_model().parameters(), lr=0.1), fragments=2, process_group=outer,
               replica_group=replica)
    except ValueError as e:
        assert "whole-model outer steps" in str(e), e
    else:
        raise AssertionError("fragments with replica_group were accepted")
    try:
        DiLoCo(make_model(), torch.optim.SGD(make_model().parameters(), lr=0.1), process_group=replica, replica_group=replica)
    except ValueError as e:
        assert "one index in every replica" in str(e), e
    else:
        raise AssertionError("a process_group of one replica's ranks was accepted")


def ring_bytes(numel: int, name: str) -> int:
    """What one rank of a 2-rank outer group sends for the whole model in 3 outer steps."""
    per_step = ring_all_reduce_bytes(numel * 4, 2) if name == "none" else wire_bytes(COMPRESSORS[name](), numel, 2, 0)
    return 3 * per_step


if __name__ == "__main__":
    run()
