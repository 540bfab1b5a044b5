"""One replica of ``bench.slownet.run_torchft_faults``: DiLoCo on one host of the emulated
network, under torchft (a replica group of one rank that survives the loss of others) or, with
``--elastic``, as one rank of ddlcomm's own ``DiLoCo`` under ``torchrun --max-restarts`` (every
rank restarts after a failure and resumes from the last checkpoint).

    python -m bench.torchft_faults --lighthouse http://10.0.0.1:29510 --replica 2 \
        --address 10.0.0.3 --events run/replica2.jsonl [--die-at 8] [--snapshots run/snapshots]
    torchrun ... -m bench.torchft_faults --elastic --checkpoints run/checkpoints --replica 2 \
        --events run/replica2.jsonl [--die-at 8,18]

Both train ``bench.tasks``' CNN (``--width``) with Adam and outer Nesterov SGD steps (lr 1.0,
momentum 0.5: ``ddlcomm.diloco.DiLoCo``'s defaults) every ``--sync-every`` inner steps until
``--outer-steps`` outer steps are done; the learning rate follows the global inner step, so a
replica that rejoins or resumes continues the schedule where the others are. Under torchft the
replicas use torchft's gloo process group, or ``ddlcomm.torchft.ProcessGroupDdlcomm``
(``--process-group ddlcomm``); ``--compressor`` sends the pseudo-gradients through a ddlcomm
compressor (ddlcomm groups only).

``--die-at``: under torchft, the replica SIGKILLs itself in the sync of that outer step, after
the quorum and before the all-reduce (the others wait in it); the driver starts it again without
the option and it heals from a live peer. With ``--elastic``, a list:
failure ``i`` takes rank ``world - 1 - i`` just before the all-reduce of outer step ``die_at[i]``,
once (a file in ``--checkpoints`` records it).

Every line of ``--events`` is one JSON event with the wall time ``t`` (``time.time()``): ``start``;
``sync`` (``began``, ``t``, ``step`` after it, ``committed``, ``participants``); ``checkpoint``
(elastic); ``snapshot`` (the model saved for the driver's evaluation by the replica or rank
given ``--snapshots``, with the ``seconds`` it took, which the driver takes off the clock);
``done``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import time
from datetime import timedelta
from pathlib import Path
from typing import Callable

import torch

from ddlcomm import compressors

from bench.tasks import Task, lr_lambda, make_task
from bench.torchft_diloco import COMPRESSORS, install_compressor, manager_state, process_group

Event = Callable[..., None]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replica", type=int, required=True, help="this replica's host")
    parser.add_argument("--events", type=Path, required=True, help="the .jsonl file events are appended to")
    parser.add_argument("--elastic", action="store_true",
                        help="a rank of ddlcomm's DiLoCo under torchrun, resuming from --checkpoints")
    parser.add_argument("--lighthouse", default=None, help="torchft lighthouse address (http://host:port)")
    parser.add_argument("--address", default="127.0.0.1",
                        help="this host's address: its store and torchft's servers are reached there")
    parser.add_argument("--process-group", choices=("gloo", "ddlcomm"), default="ddlcomm",
                        help="torchft's gloo process group, or ddlcomm.torchft.ProcessGroupDdlcomm")
    parser.add_argument("--compressor", choices=sorted(COMPRESSORS), default=None,
                        help="pseudo-gradients through this ddlcomm compressor (ddlcomm groups only); "
                             "default: float32")
    parser.add_argument("--min-replicas", type=int, default=2, help="the smallest torchft quorum to train in")
    parser.add_argument("--outer-steps", type=int, default=30, help="outer steps to commit")
    parser.add_argument("--sync-every", type=int, default=10, help="inner steps between outer steps (H)")
    parser.add_argument("--width", type=int, default=8192, help="the CNN's hidden width")
    parser.add_argument("--batch", type=int, default=16, help="samples per inner step")
    parser.add_argument("--lr", type=float, default=5e-4, help="Adam's peak learning rate")
    parser.add_argument("--seed", type=int, default=0, help="model and batch seed")
    parser.add_argument("--die-at", default="", help="where to SIGKILL itself (see above)")
    parser.add_argument("--checkpoints", type=Path, default=None, help="the folder of checkpoints (with --elastic)")
    parser.add_argument("--checkpoint-every", type=int, default=5, help="outer steps between checkpoints (with --elastic)")
    parser.add_argument("--snapshots", type=Path, default=None, help="save the model here every few outer steps")
    parser.add_argument("--snapshot-every", type=int, default=3, help="outer steps between snapshots")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds for torchft's and the group's operations")
    args = parser.parse_args()
    if args.elastic and args.checkpoints is None:
        parser.error("--elastic needs --checkpoints")
    if not args.elastic and args.lighthouse is None:
        parser.error("--lighthouse is needed (or --elastic)")
    return args


def build(args: argparse.Namespace) -> tuple[Task, torch.nn.Module, torch.optim.Optimizer, Callable[[int], float]]:
    """The task (of ``--outer-steps`` x ``--sync-every`` steps), the model (the same on every
    replica), Adam and the schedule."""
    torch.set_num_threads(1)
    total = args.outer_steps * args.sync_every
    task = make_task("cnn", width=args.width, batch=args.batch, steps=total)
    torch.manual_seed(args.seed)
    model = task.model()
    return task, model, torch.optim.Adam(model.parameters(), lr=args.lr), lr_lambda(total)


def train_step(args: argparse.Namespace, task: Task, model: torch.nn.Module, inner: torch.optim.Optimizer,
               schedule: Callable[[int], float], step: int, g: torch.Generator) -> None:
    """Sets the learning rate of global inner step ``step``, computes one batch's gradient."""
    for group in inner.param_groups:
        group["lr"] = args.lr * schedule(min(step, task.steps - 1))
    inner.zero_grad()
    x, y = task.batch(g)
    task.loss(model, x, y).backward()


def snapshot(args: argparse.Namespace, model: torch.nn.Module, step: int, event: Event) -> None:
    if args.snapshots and step % args.snapshot_every == 0:
        t = time.time()
        torch.save(model.state_dict(), args.snapshots / f"step{step}.pt")
        event("snapshot", step=step, file=str(args.snapshots / f"step{step}.pt"), seconds=time.time() - t)


def under_torchft(args: argparse.Namespace, event: Event) -> None:
    # torchft advertises socket.gethostname() to its peers for its checkpoint server: every
    # namespace shares this machine's name, so give each the address of its own host.
    socket.gethostname = lambda: args.address
    from torch.distributed import TCPStore
    from torchft.local_sgd import DiLoCo
    from torchft.manager import Manager

    task, model, inner, schedule = build(args)
    outer = torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.5, nesterov=True)
    store = TCPStore(args.address, 0, 1, is_master=True, wait_for_workers=False)
    timeout = timedelta(seconds=args.timeout)
    state_dict, load_state_dict = manager_state(model=model, inner=inner, outer=outer)
    pg = process_group(args.process_group, timeout)
    manager = Manager(pg=pg, min_replica_size=args.min_replicas, load_state_dict=load_state_dict,
                      state_dict=state_dict, replica_id=str(args.replica), store_addr=args.address,
                      store_port=store.port, rank=0, world_size=1, lighthouse_addr=args.lighthouse,
                      hostname=args.address, use_async_quorum=False, timeout=timeout, quorum_timeout=timeout * 2,
                      connect_timeout=timeout, init_sync=False)
    if args.compressor:
        install_compressor(manager, args.compressor, model)
    if args.die_at:
        allreduce = manager.allreduce

        def die_in_sync(tensor: torch.Tensor, *rest, **options):
            if manager.current_step() >= int(args.die_at):
                os.kill(os.getpid(), signal.SIGKILL)
            return allreduce(tensor, *rest, **options)

        manager.allreduce = die_in_sync

    event("start")
    g = torch.Generator().manual_seed(args.seed * 1000 + args.replica)
    local = 0  # inner steps since the last sync, as DiLoCo counts them
    with DiLoCo(manager, [model], inner, outer, sync_every=args.sync_every):
        while manager.current_step() < args.outer_steps:
            train_step(args, task, model, inner, schedule, manager.current_step() * args.sync_every + local, g)
            began, before = time.time(), manager.current_step()
            inner.step()  # DiLoCo's hook syncs on every sync_every-th call
            local += 1
            if local < args.sync_every:
                continue
            local = 0
            step = manager.current_step()
            event("sync", began=began, step=step, committed=step > before, participants=manager.num_participants())
            if step > before:
                snapshot(args, model, step, event)
    event("done", step=manager.current_step())
    manager.shutdown(wait=False)
    pg.shutdown()


def elastic(args: argparse.Namespace, event: Event) -> None:
    """One rank of ddlcomm's DiLoCo under torchrun --max-restarts: after a failure torchrun
    starts every rank again, and each resumes from the newest outer step that every rank had
    saved (``--checkpoints``, every ``--checkpoint-every`` outer steps)."""
    import torch.distributed as dist

    from ddlcomm.diloco import DiLoCo

    dist.init_process_group("ddlcomm")
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    deaths = [int(s) for s in args.die_at.split(",") if s]
    task, model, inner, schedule = build(args)
    compressor = getattr(compressors, COMPRESSORS[args.compressor])() if args.compressor else None
    diloco = DiLoCo(model, inner, sync_every=args.sync_every, compressor=compressor)

    def path(step: int, r: int) -> Path:
        return args.checkpoints / f"step{step}.rank{r}.pt"

    saved = [s for s in range(args.outer_steps, 0, -1) if all(path(s, r).exists() for r in range(world))]
    if saved:
        state = torch.load(path(saved[0], rank))
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["inner"])
        diloco.load_state_dict(state["diloco"])
    event("start", rank=rank, attempt=attempt, resumed_at=saved[0] if saved else 0)
    g = torch.Generator().manual_seed((args.seed * 1000 + rank) * 100 + attempt)
    while diloco.outer_steps < args.outer_steps:
        train_step(args, task, model, inner, schedule, diloco.inner_steps, g)
        began = time.time()
        inner.step()
        if deaths and (diloco.inner_steps + 1) % args.sync_every == 0:  # this step() syncs
            # Failure i once, whatever the attempt (torchrun's agents count restarts differently)
            failure = len(list(args.checkpoints.glob("failure*")))
            if failure < len(deaths) and rank == world - 1 - failure and diloco.outer_steps + 1 == deaths[failure]:
                (args.checkpoints / f"failure{failure}").touch()
                os.kill(os.getpid(), signal.SIGKILL)  # the others are in the outer step's all-reduce
        diloco.step()
        if diloco.inner_steps % args.sync_every:
            continue
        step = diloco.outer_steps
        event("sync", began=began, step=step, committed=True, participants=world)
        if step % args.checkpoint_every == 0:
            t = time.time()
            torch.save({"model": model.state_dict(), "inner": inner.state_dict(), "diloco": diloco.state_dict()},
                       path(step, rank))
            event("checkpoint", step=step, seconds=time.time() - t)
        if rank == 0:
            snapshot(args, model, step, event)
    event("done", step=diloco.outer_steps)
    dist.destroy_process_group()


def main() -> None:
    args = parse_args()
    log = args.events.open("a")

    def event(kind: str, **fields) -> None:
        log.write(json.dumps({"kind": kind, "replica": args.replica, "pid": os.getpid(), "t": time.time(), **fields})
                  + "\n")
        log.flush()

    (elastic if args.elastic else under_torchft)(args, event)
    log.close()


if __name__ == "__main__":
    main()
