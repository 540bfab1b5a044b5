"""Time per DDP step with CUDA gradients: each compressed hook against the group's plain
all-reduce and PyTorch's own hooks, in one run on one process group.

    python -m bench.cuda.ddp_step [--backend nccl] [--width 4096] [--layers 8]
                                          [--batch 2048] [--steps 30] [--json out.json]

Without torchrun's variables it is one rank (world size 1) on GPU 0: the all-reduce then moves
nothing, so the table isolates what a hook adds to a step on the GPU (encode, error feedback,
decode, and the hook's own bookkeeping). Under ``torchrun --nproc-per-node N`` it runs on N
ranks (nccl: one GPU per rank). The model is an MLP of ``layers`` square Linear layers
(``width`` x ``width``), float32 parameters, TF32 matmuls, 25 MB buckets, SGD with momentum 0.9
(ddlcomm's hooks with ``optimizer=ddlcomm.optim.SGD``, as documented), or with ``--optimizer
adamw`` AdamW (ddlcomm's hooks with ``ddlcomm.optim.AdamW``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from datetime import timedelta
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from ddlcomm import compressors, hooks, optim

from bench import init_ranks


def optimizer(name: str, params: Any, ours: bool) -> torch.optim.Optimizer:
    """`name`'s optimizer (sgd: momentum 0.9; adamw: betas (0.9, 0.95), weight decay 0.1), torch's
    or ddlcomm.optim's (whose directions the hooks average)."""
    module = optim if ours else torch.optim
    if name == "adamw":
        return module.AdamW(params, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
    return module.SGD(params, lr=1e-4, momentum=0.9)


def _hooks(group: dist.ProcessGroup, opt_name: str) -> dict[str, Optional[Callable]]:
    """Name -> make(model) -> (state, hook, optimizer) for DDP.register_comm_hook; None: DDP's
    own all-reduce with torch's optimizer. ddlcomm's hooks run as documented, with optimizer=."""
    def torch_hook(state: Callable[[], Any], hook: Callable) -> Callable:
        return lambda model: (state(), hook, optimizer(opt_name, model.parameters(), False))

    def ddlcomm_hook(compressor: compressors.Compressor) -> Callable:
        def make(model: torch.nn.Module) -> tuple[Any, Callable, torch.optim.Optimizer]:
            opt = optimizer(opt_name, model.parameters(), True)
            state = hooks.CompressionState(group, compressor, start_compress_iter=2, optimizer=opt, model=model)
            return state, hooks.compressed_hook, opt
        return make

    return {
        "all-reduce (no hook)": None,
        "torch fp16_compress_hook": torch_hook(lambda: group, default_hooks.fp16_compress_hook),
        "torch PowerSGD rank 4": torch_hook(lambda: powerSGD_hook.PowerSGDState(
            group, matrix_approximation_rank=4, start_powerSGD_iter=2), powerSGD_hook.powerSGD_hook),
        "ddlcomm fp16": ddlcomm_hook(compressors.FP16()),
        "ddlcomm 1-bit": ddlcomm_hook(compressors.OneBit()),
        "ddlcomm ternary": ddlcomm_hook(compressors.Ternary()),
        "ddlcomm top-k 1% (approx.)": ddlcomm_hook(compressors.TopK(ratio=0.01, approximate=True)),
    }


def _step_times(args: argparse.Namespace, device: torch.device, make: Optional[Callable],
                profiler: Any = None) -> list[float]:
    """Milliseconds of each timed step (forward, backward, the hook's communication, SGD); a
    torch profiler, if given, records the timed steps."""
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(args.layers):
        layers += [torch.nn.Linear(args.width, args.width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers).to(device)
    ddp = DistributedDataParallel(model, device_ids=[device.index], bucket_cap_mb=25)
    if make is None:
        opt = optimizer(args.optimizer, model.parameters(), False)
    else:
        state, hook, opt = make(model)
        ddp.register_comm_hook(state, hook)
    x = torch.randn(args.batch, args.width, device=device)
    times = []
    for step in range(args.warmup + args.steps):
        if step == args.warmup and profiler is not None:
            profiler.start()
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        opt.zero_grad(set_to_none=False)
        ddp(x).square().mean().backward()
        opt.step()
        torch.cuda.synchronize(device)
        if step >= args.warmup:
            times.append((time.perf_counter() - start) * 1e3)
    if profiler is not None:
        profiler.stop()
    return times


def _profile(args: argparse.Namespace, device: torch.device, make: Optional[Callable]) -> None:
    """Where one hook's step time goes: torch.profiler over the timed steps only (set-up and
    warm-up left out), by self CPU time and by GPU time."""
    from torch.profiler import ProfilerActivity, profile

    args.steps = 5
    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    times = _step_times(args, device, make, prof)
    print(f"{args.steps} steps, median {statistics.median(times):.2f} ms")
    for key in ("self_cpu_time_total", "cuda_time_total"):
        print(prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=60))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="nccl", help="process group backend (nccl, gloo, ddlcomm)")
    parser.add_argument("--width", type=int, default=4096, help="hidden width of the MLP")
    parser.add_argument("--layers", type=int, default=8, help="hidden layers of the MLP")
    parser.add_argument("--batch", type=int, default=2048, help="per-rank batch")
    parser.add_argument("--warmup", type=int, default=8, help="untimed steps first (the hooks compress from the third)")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per method")
    parser.add_argument("--optimizer", choices=["sgd", "adamw"], default="sgd",
                        help="every method's optimizer: SGD with momentum 0.9, or AdamW (0.9, 0.95), weight decay 0.1")
    parser.add_argument("--json", help="also write the rows here")
    parser.add_argument("--profile", metavar="HOOK", help="instead, torch.profiler's table for HOOK's steps "
                        "(a name from the table, e.g. 'ddlcomm 1-bit')")
    args = parser.parse_args()
    if "RANK" not in os.environ:  # one rank, without torchrun
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29517")
    torch.backends.cuda.matmul.allow_tf32 = True
    init_ranks(args.backend, timeout=timedelta(seconds=120))
    rank, n = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
    torch.cuda.set_device(device)
    params = args.layers * (args.width * args.width + args.width)
    if args.profile:
        _profile(args, device, _hooks(dist.group.WORLD, args.optimizer)[args.profile])
        dist.destroy_process_group()
        return
    rows = []
    for name, make in _hooks(dist.group.WORLD, args.optimizer).items():
        times = _step_times(args, device, make)
        rows.append({"hook": name, "median_ms": statistics.median(times), "min_ms": min(times)})
    if rank == 0:
        base = rows[0]["median_ms"]
        print(f"DDP step, {torch.cuda.get_device_name(device)}, {args.backend} x{n}, torch {torch.__version__}: "
              f"{args.layers} x Linear({args.width}) = {params / 1e6:.0f} M parameters "
              f"({params * 4 / 2**20:.0f} MiB of float32 gradients), batch {args.batch}, 25 MB buckets, "
              f"{args.optimizer}, "
              f"median of {args.steps} steps after {args.warmup}")
        print(f"{'hook':<30}{'ms/step':>10}{'min ms':>10}{'vs all-reduce':>15}")
        for row in rows:
            row["vs_all_reduce"] = row["median_ms"] / base
            print(f"{row['hook']:<30}{row['median_ms']:>10.2f}{row['min_ms']:>10.2f}{row['vs_all_reduce']:>14.2f}x")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(device), "backend": args.backend, "world_size": n,
                           "parameters": params, "args": vars(args), "rows": rows}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
