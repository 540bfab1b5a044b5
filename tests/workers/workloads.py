"""Real training stacks on a process group, run by tests/test_workloads.py once on ddlcomm and
once on gloo: every rank writes its losses and parameters, which the test compares between
the two backends."""

from __future__ import annotations

import json
import tempfile

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from common import init, run

STEPS = 4


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.ReLU(),
                               torch.nn.Linear(32, 4))


def _batch(step: int, rank: int, rows: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(rows, 16, generator=g), torch.randn(rows, 4, generator=g)


def _report(losses: list[float], params: list[torch.Tensor]) -> dict:
    flat = torch.cat([p.detach().reshape(-1).double() for p in params]) if params else torch.zeros(0)
    return {"losses": losses, "params": flat.tolist()}


def _train(model: torch.nn.Module, steps: int = STEPS, step_fn=None) -> list[float]:
    rank = dist.get_rank()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for step in range(steps):
        x, y = _batch(step, rank)
        loss = torch.nn.functional.mse_loss(model(x), y) if step_fn is None else step_fn(model, x, y, step)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def fsdp2(divide_factor: float = 0.0) -> dict:
    """FSDP2: fully_shard per layer and at the root; optionally a gradient divide factor other
    than the world size (FSDP2 then reduce-scatters with PREMUL_SUM, or SUM and a division)."""
    from torch.distributed.fsdp import fully_shard

    model = _mlp()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    if divide_factor:
        model.set_gradient_divide_factor(divide_factor)
    losses = _train(model)
    return _report(losses, [p.full_tensor() for p in model.parameters()])


def tensor_parallel() -> dict:
    """DTensor tensor parallelism: column-wise then row-wise linear layers."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    rank, n = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (n,))
    model = _mlp()
    model = parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel(),
                                             "4": ColwiseParallel(output_layouts=torch.distributed.tensor.Replicate())})

    def step(model, x, y, step):
        x, y = _batch(step, 0)  # tensor parallelism: every rank sees the same batch
        return torch.nn.functional.mse_loss(model(x), y)

    losses = _train(model, step_fn=step)
    return _report(losses, [p.full_tensor() for p in model.parameters()])


def checkpoint() -> dict:
    """torch.distributed.checkpoint: save an FSDP2-sharded model and its optimizer, load them
    into a fresh one, and train on: the same as training straight through."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard

    rank, n = dist.get_rank(), dist.get_world_size()

    def job():
        model = _mlp()
        fully_shard(model)
        return model, torch.optim.Adam(model.parameters(), lr=1e-2)

    def steps(model, opt, begin, end):
        for step in range(begin, end):
            x, y = _batch(step, rank)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()

    straight, opt = job()
    steps(straight, opt, 0, 6)
    first, opt = job()
    steps(first, opt, 0, 3)
    path = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(path)
    model_sd, opt_sd = get_state_dict(first, opt)
    dcp.save({"model": model_sd, "optim": opt_sd}, checkpoint_id=path[0])
    resumed, opt = job()
    model_sd, opt_sd = get_state_dict(resumed, opt)
    state = {"model": model_sd, "optim": opt_sd}
    dcp.load(state, checkpoint_id=path[0])
    set_state_dict(resumed, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    steps(resumed, opt, 3, 6)
    for a, b in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(a.full_tensor(), b.full_tensor()), "checkpointed training differs from straight training"
    return _report([], [p.full_tensor() for p in resumed.parameters()])


def pipeline() -> dict:
    """torch.distributed.pipelining: two stages, one per rank, GPipe over 4 micro-batches."""
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    rank, n = dist.get_rank(), dist.get_world_size()
    assert n == 2
    full = _mlp()
    stage_module = full[:2] if rank == 0 else full[2:]
    stage = PipelineStage(stage_module, rank, n, torch.device("cpu"))
    losses: list[float] = []
    schedule = ScheduleGPipe(stage, n_microbatches=4, loss_fn=torch.nn.functional.mse_loss)
    opt = torch.optim.SGD(stage_module.parameters(), lr=0.05)
    for step in range(STEPS):
        x, y = _batch(step, 0, rows=16)
        opt.zero_grad()
        if rank == 0:
            schedule.step(x)
        else:
            step_losses: list[torch.Tensor] = []
            schedule.step(target=y, losses=step_losses)
            losses.append(sum(l.item() for l in step_losses))
        opt.step()
    everyone: list = [None] * n
    dist.all_gather_object(everyone, [p.detach() for p in stage_module.parameters()])
    return _report(losses, [p for part in everyone for p in part])


class _WithUnused(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = _mlp()
        self.unused = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def ddp_variants() -> dict:
    """DDP with static_graph, find_unused_parameters, no_sync accumulation and uneven inputs
    under Join."""
    from torch.distributed.algorithms.join import Join

    rank, n = dist.get_rank(), dist.get_world_size()
    losses, params = [], []
    for name, kwargs in (("static_graph", {"static_graph": True}), ("find_unused", {"find_unused_parameters": True})):
        model = DistributedDataParallel(_WithUnused() if name == "find_unused" else _mlp(), **kwargs)
        losses += _train(model)
        params += list(model.parameters())

    model = DistributedDataParallel(_mlp())

    def accumulate(model, x, y, step):
        with model.no_sync():
            torch.nn.functional.mse_loss(model(x[:4]), y[:4]).backward()
        return torch.nn.functional.mse_loss(model(x[4:]), y[4:])

    losses += _train(model, step_fn=accumulate)
    params += list(model.parameters())

    model = DistributedDataParallel(_mlp())
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with Join([model]):
        for step in range(STEPS + rank):  # rank r runs r more steps than rank 0
            x, y = _batch(step, rank)
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
    params += list(model.parameters())
    return _report(losses, params)


def sparse_embedding() -> dict:
    """DDP over an nn.Embedding(sparse=True): DDP all-reduces sparse gradients."""
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Embedding(50, 8, sparse=True), torch.nn.Flatten(),
                                                        torch.nn.Linear(24, 4)))

    def step(model, x, y, step):
        g = torch.Generator().manual_seed(100 * step + rank)
        return torch.nn.functional.mse_loss(model(torch.randint(0, 50, (8, 3), generator=g)), y)

    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for i in range(STEPS):
        x, y = _batch(i, rank)
        opt.zero_grad()
        loss = step(model, x, y, i)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return _report(losses, list(model.parameters()))


def objects() -> dict:
    """The object collectives: all_gather_object, gather_object, broadcast_object_list,
    scatter_object_list, with objects of different sizes per rank."""
    rank, n = dist.get_rank(), dist.get_world_size()
    mine = {"rank": rank, "payload": "x" * (10 + 1000 * rank), "tensor": torch.arange(rank + 1)}
    everyone: list = [None] * n
    dist.all_gather_object(everyone, mine)
    assert [o["rank"] for o in everyone] == list(range(n)) and len(everyone[-1]["payload"]) == 10 + 1000 * (n - 1)
    gathered: list | None = [None] * n if rank == 1 else None
    dist.gather_object(mine, gathered, dst=1)
    if rank == 1:
        assert [o["rank"] for o in gathered] == list(range(n))
    objs = [{"from": 0, "big": list(range(5000))}, "two"] if rank == 0 else [None, None]
    dist.broadcast_object_list(objs, src=0)
    assert objs[1] == "two" and objs[0]["big"][-1] == 4999
    out: list = [None]
    dist.scatter_object_list(out, [f"to {r}" * (r + 1) for r in range(n)] if rank == 0 else None, src=0)
    assert out[0] == f"to {rank}" * (rank + 1)
    return _report([], [])


WORKLOADS = {
    "fsdp2": fsdp2,
    "fsdp2_divide_factor": lambda: fsdp2(divide_factor=3.0),  # not the world size
    "tensor_parallel": tensor_parallel,
    "checkpoint": checkpoint,
    "pipeline": pipeline,
    "ddp_variants": ddp_variants,
    "sparse_embedding": sparse_embedding,
    "objects": objects,
}


def suite(backend: str, out_dir: str, *names: str) -> None:
    """Runs the named workloads in order on one `backend` group; writes their results to
    `out_dir/<backend>-rank<r>.json` (a file: a pipe would fill up and block the rank)."""
    rank, _ = init(backend)
    results = {name: WORKLOADS[name]() for name in names}
    with open(f"{out_dir}/{backend}-rank{rank}.json", "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    run()
