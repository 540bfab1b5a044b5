"""Time to accuracy: train with each method and record the metric against wall-clock time.

Launched once per rank (env:// rendezvous), normally by
``bench.slownet.run_time_to_accuracy`` inside the emulated hosts of
``ddlcomm.slownet``. Rank 0 prints one ``RESULT {json}`` line per method: the seconds
per step and the curve of (training seconds, step, metric), evaluated every
``--eval-every`` steps with the clock stopped.

Methods: DDP on gloo (fp32, and PyTorch's fp16_compress_hook), PyTorch's PowerSGD hook
(rank 4; on the ddlcomm group, where gloo's all-reduce of its factors failed in
bench.slownet.run_compressed), the ddlcomm hooks with their ``ddlcomm.optim`` optimizer, and outer steps
(``ddlcomm.diloco.DiLoCo``: no DDP; each rank steps its replica with torch's optimizer and the
pseudo-gradient is averaged every ``--sync-every`` steps, in float32 or compressed; streamed:
a quarter of the model at a time, each applied two inner steps late; two levels: the ranks
of a host, ``--ranks-per-host``, train one replica with DDP and only the outer step crosses
hosts, each of them syncing its part). For
DiLoCo, ``--eval-every`` should be a multiple of ``--sync-every`` so that the evaluated
weights are the synchronized ones.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

import ddlcomm  # noqa: F401  (registers the backend)
from ddlcomm import compressors, hooks, optim
from ddlcomm.diloco import DiLoCo
from ddlcomm.replicas import replica_groups

from bench import init_ranks
from bench.tasks import lr_lambda, make_task

START_COMPRESS_ITER = 10
COMPRESSORS = {
    "ddlcomm 1-bit": compressors.OneBit,
    "ddlcomm ternary": compressors.Ternary,
    "ddlcomm top-k 1%": lambda: compressors.TopK(ratio=0.01, approximate=True),
    "ddlcomm random-k 10%": lambda: compressors.RandomK(ratio=0.1),
}
# Outer steps on the ddlcomm group: (compressor, None for float32; DiLoCo's other options).
OUTER = {
    "DiLoCo fp32": (None, {}),
    "DiLoCo ternary": (compressors.Ternary, {}),
    "DiLoCo 1-bit": (compressors.OneBit, {}),
    # No comma in a name: --methods is a comma-separated list.
    "Streaming DiLoCo ternary (4 fragments; 2-step overlap)": (compressors.Ternary,
                                                                {"fragments": 4, "overlap_steps": 2}),
    "Two-level DiLoCo ternary (DDP inside a host)": (compressors.Ternary, {"two_levels": True}),
    "Overlapped DiLoCo 1-bit (2-step overlap)": (compressors.OneBit, {"overlap_steps": 2}),
    "DiLoCo top-k 5% 2-bit": (lambda: compressors.TopK(0.05, approximate=True, value_bits=2), {}),
    "DiLoCo top-k 1% 2-bit": (lambda: compressors.TopK(0.01, approximate=True, value_bits=2), {}),
}
METHODS = ["gloo fp32", "gloo fp16_compress_hook", "PowerSGD rank 4 (torch hook)", *COMPRESSORS, *OUTER]


def check_methods(methods: list[str]) -> None:
    """Exits naming the choices if any of ``methods`` is not one (every rank, before training)."""
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise SystemExit(f"unknown methods {unknown}; choose from {METHODS}")


def run(task, method: str, opt_name: str, gloo: dist.ProcessGroup, eval_every: int, outer: dict,
        seed: int = 0) -> dict:
    check_methods([method])
    rank = dist.get_rank()
    torch.manual_seed(seed)  # the model's initial weights
    model = task.model()
    group = gloo if method.startswith("gloo") else None
    outer = dict(outer)
    per_host = outer.pop("ranks_per_host", 1)
    options = dict(OUTER[method][1]) if method in OUTER else {}
    if options.pop("two_levels", False):  # DDP inside the host, the outer step across hosts
        replica, across = replica_groups(per_host)
        options.update(process_group=across, replica_group=replica)
        ddp = DistributedDataParallel(model, process_group=replica)
    else:
        ddp = model if method in OUTER else DistributedDataParallel(model, process_group=group)
    # The hooks, and a compressed warm-up, average a ddlcomm.optim optimizer's update directions.
    family = optim if method in COMPRESSORS or outer.get("warmup_compressed") else torch.optim
    lr = task.lr[opt_name]
    opt = family.SGD(model.parameters(), lr=lr, momentum=0.9) if opt_name == "sgd" else family.AdamW(model.parameters(), lr=lr)
    diloco = None
    if method in OUTER:
        make = OUTER[method][0]
        if outer.pop("warmup_compressed", False):  # the warm-up's gradients through the method's compressor
            options["warmup_compressor"] = make() if make else None
        diloco = DiLoCo(model, opt, compressor=make() if make else None, **outer, **options)
    elif method in COMPRESSORS:
        state = hooks.CompressionState(compressor=COMPRESSORS[method](), start_compress_iter=START_COMPRESS_ITER,
                                       optimizer=opt)
        ddp.register_comm_hook(state, hooks.compressed_hook)
    elif method == "gloo fp16_compress_hook":
        ddp.register_comm_hook(gloo, default_hooks.fp16_compress_hook)
    elif method.startswith("PowerSGD"):
        ddp.register_comm_hook(powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=4,
                                                           start_powerSGD_iter=START_COMPRESS_ITER),
                               powerSGD_hook.powerSGD_hook)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(task.steps))
    g = torch.Generator().manual_seed(1000 + rank + 100_000 * seed)  # each rank's batches
    curve = [(0.0, 0, task.evaluate(model))]
    # waited: in DiLoCo.step(), where outer steps wait for the wire, and in a warm-up step's
    # opt.step(), whose pre-hook averages the gradients
    clock = waited = 0.0
    dist.barrier(group=gloo)
    for step in range(1, task.steps + 1):
        start = time.perf_counter()
        x, y = task.batch(g)
        opt.zero_grad()
        task.loss(ddp, x, y).backward()
        begin = time.perf_counter()
        opt.step()
        if diloco is not None:
            if step > diloco.warmup_steps:
                begin = time.perf_counter()
            diloco.step()
            waited += time.perf_counter() - begin
        schedule.step()
        clock += time.perf_counter() - start
        if step % eval_every == 0 or step == task.steps:
            # The slowest rank's clock: every rank waits for it at the next collective anyway.
            elapsed = torch.tensor([clock])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=gloo)
            curve.append((float(elapsed), step, task.evaluate(model)))
            dist.barrier(group=gloo)
    if diloco is not None and diloco.warmup_steps:  # a row of its own beside the method without one
        kind = " compressed" if diloco.warmup_compressor is not None else ""
        method = f"{method}, {diloco.warmup_steps}{kind} warm-up steps"
    result = {"method": method, "optimizer": opt_name, "seed": seed, "seconds_per_step": curve[-1][0] / task.steps, "curve": curve}
    if diloco is not None:
        # Each rank's training seconds and those waited (above): the rest is its compute.
        seconds = [torch.zeros(2, dtype=torch.float64) for _ in range(dist.get_world_size())]
        dist.all_gather(seconds, torch.tensor([clock, waited], dtype=torch.float64), group=gloo)
        result["rank_seconds"] = [[round(float(v), 3) for v in s] for s in seconds]
        result["outer"] = dict(outer, ranks_per_host=per_host) if "replica_group" in options else outer
        result["traffic_reduction"] = diloco.stats.ratio
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", default="cnn", help="a task of bench.tasks (mlp, cnn, lm)")
    parser.add_argument("--optimizer", default="sgd", choices=("sgd", "adamw"), help="the optimizer every method trains with")
    parser.add_argument("--width", type=int, default=None, help="the task's width (CNN linear layer, LM model)")
    parser.add_argument("--batch", type=int, default=None, help="per-rank batch")
    parser.add_argument("--steps", type=int, default=None, help="override the task's step count")
    parser.add_argument("--lr", type=float, default=None, help="override the task's learning rate")
    parser.add_argument("--seed", type=int, default=0, help="the initial weights' and the batches' seed")
    parser.add_argument("--eval-every", type=int, default=20, help="steps between evaluations of the curve")
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated names from METHODS")
    parser.add_argument("--sync-every", type=int, default=10, help="DiLoCo: inner steps between outer steps")
    parser.add_argument("--outer-lr", type=float, default=0.7, help="DiLoCo: the outer SGD's learning rate")
    parser.add_argument("--outer-momentum", type=float, default=0.5, help="DiLoCo: the outer Nesterov momentum")
    parser.add_argument("--warmup-steps", type=int, default=0,
                        help="DiLoCo: first inner steps, each on the replicas' average gradient")
    parser.add_argument("--warmup-compressed", action="store_true",
                        help="DiLoCo: the warm-up's gradients through the method's compressor (else float32)")
    parser.add_argument("--ranks-per-host", type=int, default=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
                        help="two-level DiLoCo: the ranks of a host, which train one replica (default: "
                             "LOCAL_WORLD_SIZE, as torchrun sets it)")
    args = parser.parse_args()
    check_methods(args.methods.split(","))
    init_ranks("ddlcomm")
    gloo = dist.new_group(backend="gloo")
    torch.set_num_threads(1)
    options = {k: v for k, v in (("width", args.width), ("batch", args.batch), ("steps", args.steps)) if v is not None}
    task = make_task(args.task, **options)
    if args.lr is not None:
        task.lr[args.optimizer] = args.lr
    params = sum(p.numel() for p in task.model().parameters())
    for method in args.methods.split(","):
        outer = {"sync_every": args.sync_every, "outer_lr": args.outer_lr, "outer_momentum": args.outer_momentum,
                 "warmup_steps": args.warmup_steps,
                 "warmup_compressed": args.warmup_compressed, "ranks_per_host": args.ranks_per_host}
        result = run(task, method, args.optimizer, gloo, args.eval_every, outer, args.seed)
        result.update(options, task=task.name, metric=task.metric, params=params, steps=task.steps,
                      lr=task.lr[args.optimizer])
        if dist.get_rank() == 0:
            print("RESULT " + json.dumps(result), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
