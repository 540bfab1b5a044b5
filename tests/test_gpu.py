"""The CUDA paths, where a GPU is present (skipped elsewhere): the kernels through
ddlcomm.compressors, the backend with CUDA tensors, compressed all-reduces, DDP hooks, FSDP2's
compressed reduce-scatter on CUDA gradients and DiLoCo's outer steps, over ddlcomm and gloo
groups (two ranks share GPU 0) and nccl groups (one GPU per rank, so world size 1 on a one-GPU
machine: NCCL refuses two ranks on one GPU; two ranks where there are two GPUs)."""

from __future__ import annotations

import pytest
import torch

from harness import assert_all_ok, launch, named_hosts
from workers import gpu

from ddlcomm import compressors

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() and compressors.has_cuda()),
                                reason="needs a GPU and a CUDA build of ddlcomm")

COMPRESSORS = {
    "onebit": lambda: compressors.OneBit(),
    "onebit2": lambda: compressors.OneBit(block_size=64, two_scales=True),
    "ternary": lambda: compressors.Ternary(block_size=100),
    "ternary_stochastic": lambda: compressors.Ternary(stochastic=True, clip=2.5, seed=3),
    "topk": lambda: compressors.TopK(ratio=0.01),
    "topk_approx": lambda: compressors.TopK(ratio=0.01, approximate=True),
    "randomk": lambda: compressors.RandomK(ratio=0.02, seed=4, scaled=True),
    "fp16": lambda: compressors.FP16(),
    "bf16": lambda: compressors.BF16(),
}


@pytest.mark.parametrize("name", COMPRESSORS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_gpu_payloads_are_the_cpu_payloads(name: str, dtype: torch.dtype) -> None:
    """Same bytes, residuals and decodes on both devices; each decodes the other's payload."""
    c = COMPRESSORS[name]()
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(1_000_003, generator=g) * 3).to(dtype)
    residual = torch.randn(x.numel(), generator=g) * 0.1
    gpu_residual = residual.cuda()
    cpu_payload = c.encode(x, residual, stream=5)
    gpu_payload = c.encode(x.cuda(), gpu_residual, stream=5)
    assert gpu_payload.is_cuda and torch.equal(gpu_payload.cpu(), cpu_payload)
    assert torch.equal(gpu_residual.cpu(), residual)
    decoded = c.decode(cpu_payload)
    assert torch.equal(c.decode(gpu_payload).cpu(), decoded)
    assert torch.equal(c.decode(cpu_payload.cuda(), dtype=dtype).cpu(), c.decode(cpu_payload, dtype=dtype))
    acc = torch.ones(x.numel(), device="cuda")
    c.decode_accumulate(gpu_payload, acc)
    assert torch.equal(acc.cpu(), c.decode_accumulate(cpu_payload, torch.ones(x.numel())))


@pytest.mark.parametrize("name,options", [("Adam", dict(weight_decay=0.1)), ("AdamW", dict(weight_decay=0.1)),
                                          ("SGD", dict(momentum=0.9, nesterov=True))])
def test_directions_on_cuda_decide_finiteness_on_the_device(monkeypatch: pytest.MonkeyPatch, name: str,
                                                            options: dict) -> None:
    """On CUDA gradients Adam's directions, and SGD's with a sparse compressor past a buffer's
    first step, mask a non-finite gradient on the device: the same directions and moments as the
    host's decision (forced by device_finite -> None), a NaN step included, and no host
    synchronization while they are computed."""
    from ddlcomm import optim

    sgd = name == "SGD"
    runs = []
    for on_device in (True, False):
        if not on_device:
            monkeypatch.setattr(optim, "device_finite", lambda t: None)
        g = torch.Generator().manual_seed(3)
        params = [torch.nn.Parameter(torch.randn(1000, 10, generator=g).cuda())]
        opt = getattr(optim, name)(params, lr=1e-3, **options)
        directions = []
        for step in range(3):
            grad = torch.randn(1000, 10, generator=g).cuda()
            if step == 1:
                grad[5, 5] = float("nan")
            if on_device and not (sgd and step == 0):  # SGD's first step makes its buffer on the host's word
                torch.cuda.set_sync_debug_mode("error")  # a host synchronization raises
            try:
                opt.local_directions(params, [grad], ranks=2, sparse=sgd)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            directions.append(grad.cpu())
        runs.append((directions, [v.cpu() for v in opt.state[params[0]].values() if v.dim()]))
    for ours, theirs in zip(*runs):
        assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(ours, theirs))


def test_gpu_calls_run_on_the_current_stream() -> None:
    """An encode on a side stream sees what that stream wrote before it, without a sync."""
    c = compressors.OneBit()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        x = torch.full((1 << 24,), -1.0, device="cuda")
        x.mul_(-2.0)  # +2 everywhere, only once this kernel has run
        payload = c.encode(x)
        out = c.decode(payload)
    side.synchronize()
    assert torch.equal(out, torch.full_like(out, 2.0))


def test_gpu_bad_input_is_refused() -> None:
    c = compressors.OneBit()
    x = torch.randn(10_000, device="cuda")
    with pytest.raises(ValueError, match="one device"):
        c.encode(x, torch.zeros(10_000))
    payload = c.encode(x)
    with pytest.raises(ValueError, match="expects"):
        compressors.Ternary().decode(payload)  # another compressor's payload
    with pytest.raises(ValueError, match="bytes"):
        c.decode(payload[:-4])  # truncated
    with pytest.raises(ValueError, match="elements"):
        c.decode(payload, out=torch.empty(9_999, device="cuda"))
    with pytest.raises(ValueError, match="one device"):
        c.decode(payload, out=torch.empty(10_000))
    with pytest.raises(ValueError, match="host"):
        compressors.inspect(payload)


def test_backend_collectives_on_cuda_tensors() -> None:
    assert_all_ok(launch(gpu.collectives, 2, timeout=180))


# (backend, ranks): two ranks share GPU 0 on ddlcomm and gloo; nccl gets one GPU per rank.
GROUPS = [("ddlcomm", 2), ("gloo", 2), ("nccl", 1),
          pytest.param("nccl", 2, marks=pytest.mark.skipif(torch.cuda.device_count() < 2,
                                                           reason="NCCL needs one GPU per rank"))]


def _print_accuracy(results) -> None:
    for line in results[0].output.splitlines():
        if line.startswith("ACCURACY"):
            print(line)


@pytest.mark.parametrize("backend,ranks", GROUPS)
def test_compressed_all_reduce_on_cuda_matches_cpu(backend: str, ranks: int) -> None:
    assert_all_ok(launch(gpu.compressed, ranks, timeout=240, args=(backend,)))


def test_compressed_all_reduce_on_cuda_over_two_hosts_matches_cpu() -> None:
    """2 named hosts x 2 ranks of a ddlcomm group: CUDA tensors take the collectives path's two levels,
    CPU ones the native hierarchy; with two ranks a host both give the same bits."""
    assert_all_ok(launch(gpu.compressed, 4, timeout=300, args=("ddlcomm",), rank_env=named_hosts()))


@pytest.mark.parametrize("backend,ranks", GROUPS)
def test_ddp_hooks_on_cuda_match_cpu_accuracy(backend: str, ranks: int) -> None:
    results = launch(gpu.ddp, ranks, timeout=600, args=(backend,))
    _print_accuracy(results)
    assert_all_ok(results)


@pytest.mark.parametrize("backend,ranks", [g for g in GROUPS if g != ("gloo", 2)])
def test_fsdp_reduce_scatter_on_cuda_matches_cpu(backend: str, ranks: int) -> None:
    assert_all_ok(launch(gpu.fsdp_reduce_scatter, ranks, timeout=240, args=(backend,)))


@pytest.mark.parametrize("backend,ranks", GROUPS)
def test_fsdp_moments_on_cuda_match_cpu_without_host_syncs(backend: str, ranks: int) -> None:
    assert_all_ok(launch(gpu.fsdp_moments, ranks, timeout=240, args=(backend,)))


@pytest.mark.parametrize("backend,ranks", [GROUPS[0], GROUPS[3]])  # FSDP2 on one rank reduces nothing
def test_fsdp_training_on_cuda_matches_cpu_accuracy(backend: str, ranks: int) -> None:
    results = launch(gpu.fsdp_training, ranks, timeout=600, args=(backend,))
    _print_accuracy(results)
    assert_all_ok(results)


@pytest.mark.parametrize("backend,ranks", GROUPS)
def test_diloco_on_cuda_matches_cpu_accuracy(backend: str, ranks: int) -> None:
    results = launch(gpu.diloco, ranks, timeout=600, args=(backend,))
    _print_accuracy(results)
    assert_all_ok(results)
