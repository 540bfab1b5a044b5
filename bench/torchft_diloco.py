"""torchft's DiLoCo (``torchft.local_sgd.DiLoCo``) on the recipe of ``bench.diloco``: the
anchor its float32 row is checked against. Needs torchft (``pip install --no-deps torchft`` plus
its opentelemetry packages; not a dependency of ddlcomm).

    python -m bench.torchft_diloco --recipe lm-adamw-clip --replicas 4 --seeds 3 \
        --out docs/results/torchft_diloco.json

Starts torchft's lighthouse and one process per replica (a replica group of one rank each, over
torchft's gloo process group, as its tests run on CPUs, or with ``--process-group ddlcomm`` over
``ddlcomm.torchft.ProcessGroupDdlcomm``, and with ``--compressor ternary`` its pseudo-gradients
through ddlcomm's compressed all-reduce, ``ddlcomm.torchft.CompressedAverager``). Every replica trains exactly as
``bench.diloco.run`` does (same model seed, per-rank batches, optimizer, schedule,
clipping) with torchft's DiLoCo syncing every ``--sync-every`` steps through an outer Nesterov
SGD of the same learning rate and momentum. Prints one ``RESULT {json}`` line per seed and the
mean and standard deviation of the metric.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
from datetime import timedelta
from pathlib import Path
from typing import Callable

import torch
import torch.multiprocessing as mp

from bench.convergence import RECIPES
from bench.tasks import lr_lambda, make_task

# --compressor: what the pseudo-gradients go through (names of bench.diloco's methods)
COMPRESSORS = {"ternary": "Ternary", "1-bit": "OneBit"}


def process_group(name: str, timeout: timedelta):
    """torchft's gloo process group, or ddlcomm's (``--process-group``)."""
    if name == "ddlcomm":
        from ddlcomm.torchft import ProcessGroupDdlcomm

        return ProcessGroupDdlcomm(timeout=timeout)
    from torchft.process_group import ProcessGroupGloo

    return ProcessGroupGloo(timeout=timeout)


def manager_state(**parts) -> tuple[Callable[[], dict], Callable[[dict], None]]:
    """torchft ``Manager``'s ``state_dict`` and ``load_state_dict`` over ``parts``' own (what a
    healing replica fetches from a live one), keyed by the parts' names."""

    def state_dict() -> dict:
        return {name: part.state_dict() for name, part in parts.items()}

    def load_state_dict(state: dict) -> None:
        for name, part in parts.items():
            part.load_state_dict(state[name])

    return state_dict, load_state_dict


def install_compressor(manager, name: str, model: torch.nn.Module) -> None:
    """Sends the pseudo-gradients of ``manager``'s syncs through the ddlcomm compressor
    ``--compressor`` names (``ddlcomm.torchft.CompressedAverager``)."""
    from ddlcomm import compressors
    from ddlcomm.torchft import CompressedAverager

    CompressedAverager(manager, getattr(compressors, COMPRESSORS[name])(), model.parameters()).install()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def replica(index: int, args: argparse.Namespace, seed: int, lighthouse: str, results) -> None:
    from torch.distributed import TCPStore
    from torchft.local_sgd import DiLoCo
    from torchft.manager import Manager

    torch.set_num_threads(1)
    recipe = RECIPES[args.recipe]
    task = make_task(recipe.task, **({"steps": args.steps} if args.steps else {}))
    torch.manual_seed(seed)
    model = task.model()
    inner = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[recipe.optimizer](
        model.parameters(), lr=recipe.lr, **recipe.options)
    schedule = torch.optim.lr_scheduler.LambdaLR(inner, lr_lambda(task.steps))
    outer = torch.optim.SGD(model.parameters(), lr=args.outer_lr, momentum=args.outer_momentum,
                            nesterov=args.outer_momentum > 0)  # as ddlcomm.diloco.DiLoCo
    store_port = free_port()
    store = TCPStore("127.0.0.1", store_port, 1, is_master=True, wait_for_workers=False)  # this replica's own
    state_dict, load_state_dict = manager_state(model=model, inner=inner)
    pg = process_group(args.process_group, timedelta(seconds=60))
    manager = Manager(pg=pg, min_replica_size=args.replicas,
                      load_state_dict=load_state_dict, state_dict=state_dict, replica_id=str(index),
                      store_addr="127.0.0.1", store_port=store_port, rank=0, world_size=1,
                      lighthouse_addr=lighthouse, use_async_quorum=False, timeout=timedelta(seconds=60),
                      # Every replica starts from the same seed, as ddlcomm's do. With init_sync,
                      # replica 1 heals from replica 0 at the first quorum and sits out the first
                      # outer step (its pseudo-gradient zeroed, the sum still divided by 2).
                      init_sync=False)
    if args.compressor:
        install_compressor(manager, args.compressor, model)
    g = torch.Generator().manual_seed(seed * 1000 + index)  # bench.diloco's batches
    with DiLoCo(manager, [model], inner, outer, sync_every=args.sync_every):
        for _ in range(task.steps):
            inner.zero_grad()
            for _ in range(recipe.micro_batches):
                x, y = task.batch(g)
                task.loss(model, x, y).backward()
            if recipe.clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.clip)
            inner.step()  # DiLoCo takes its outer step from this step's hook every sync_every
            schedule.step()
    results[index] = task.evaluate(model)
    manager.shutdown()
    del store


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="lm-adamw-clip", choices=sorted(RECIPES), help="the recipe to train")
    parser.add_argument("--replicas", type=int, default=4, help="replicas (processes), as ranks in bench.diloco")
    parser.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1")
    parser.add_argument("--steps", type=int, default=None, help="inner steps (default: the task's)")
    parser.add_argument("--sync-every", type=int, default=10, help="inner steps between outer steps (H)")
    parser.add_argument("--outer-lr", type=float, default=0.7, help="the outer Nesterov SGD's learning rate")
    parser.add_argument("--outer-momentum", type=float, default=0.5, help="its momentum")
    parser.add_argument("--process-group", choices=("gloo", "ddlcomm"), default="gloo",
                        help="the replicas' process group: torchft's gloo one, or ddlcomm.torchft.ProcessGroupDdlcomm")
    parser.add_argument("--compressor", choices=sorted(COMPRESSORS), default=None,
                        help="average the pseudo-gradients through this ddlcomm compressor (needs --process-group "
                             "ddlcomm); default: float32, torchft's own all-reduce")
    parser.add_argument("--out", type=Path, default=None, help="a .json file for the per-seed results")
    args = parser.parse_args()
    if args.compressor and args.process_group != "ddlcomm":
        parser.error("--compressor needs --process-group ddlcomm")
    try:
        from torchft._torchft import LighthouseServer
    except ImportError as e:
        raise SystemExit(f"bench.torchft_diloco needs torchft: pip install --no-deps torchft "
                         f"opentelemetry-sdk opentelemetry-exporter-otlp-proto-http ({e})") from None

    metrics, records = [], []
    for seed in range(args.seeds):
        lighthouse = LighthouseServer(bind="[::]:0", min_replicas=args.replicas)
        results = mp.Manager().dict()
        procs = [mp.get_context("spawn").Process(target=replica, args=(i, args, seed, lighthouse.address(), results))
                 for i in range(args.replicas)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        lighthouse.shutdown()
        if any(p.exitcode for p in procs) or len(results) != args.replicas:
            raise SystemExit(f"a replica failed: exit codes {[p.exitcode for p in procs]}")
        values = [results[i] for i in range(args.replicas)]
        metrics.append(values[0])
        records.append({"seed": seed, "metric": values[0], "replicas": values})
        print("RESULT " + json.dumps(records[-1]), flush=True)
    sd = statistics.stdev(metrics) if len(metrics) > 1 else 0.0
    print(f"torchft DiLoCo over {args.process_group}{', ' + args.compressor if args.compressor else ''} "
          f"({args.recipe}, H={args.sync_every}, outer lr {args.outer_lr:g} momentum "
          f"{args.outer_momentum:g}): {statistics.fmean(metrics):.3f} ± {sd:.3f} over {len(metrics)} seeds", flush=True)
    if args.out:
        args.out.write_text(json.dumps({"recipe": args.recipe, "replicas": args.replicas, "sync_every": args.sync_every,
                                        "outer_lr": args.outer_lr, "outer_momentum": args.outer_momentum,
                                        "process_group": args.process_group, "compressor": args.compressor,
                                        "results": records}, indent=1))


if __name__ == "__main__":
    main()
