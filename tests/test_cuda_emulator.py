"""The CUDA kernels' test program (tests/cuda) on the CPU emulator (tests/cuda/emu).

Checks the kernels' logic (indexing, bit packing, scans, warp collectives, barriers, bounds
under AddressSanitizer) against the payload contract on machines without a GPU, CI included.
It cannot see races or measure anything: scripts/gpu_check.sh does that on a GPU machine.
"""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_cuda_kernels_on_cpu_emulator():
    if shutil.which("cmake") is None or (shutil.which("c++") is None and shutil.which("g++") is None):
        pytest.skip("needs cmake and a C++ compiler")
    build = ROOT / "build" / "cuda-emu"
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    for cmd in (["cmake", "-S", str(ROOT / "tests" / "cuda" / "emu"), "-B", str(build), *generator],
                ["cmake", "--build", str(build), "-j", str(os.cpu_count() or 2)]):
        step = subprocess.run(cmd, capture_output=True, text=True)
        assert step.returncode == 0, step.stdout[-6000:] + step.stderr[-6000:]
    run = subprocess.run([str(build / "test_cuda_kernels_emu"), "--quick", "--seed=1"], capture_output=True,
                         text=True, timeout=900)
    assert run.returncode == 0 and " 0 failed" in run.stdout, run.stdout[-6000:] + run.stderr[-3000:]
    # docs/results/cuda_launches.md's counter: a row per compressor and world size, every kernel counted.
    run = subprocess.run([str(build / "cuda_launches_emu"), "--bucket-mb=1"], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = [[cell.strip() for cell in line.split("|")[1:4]] for line in run.stdout.splitlines()
            if line.startswith("| ") and "ranks" not in line]
    launches = {(name, int(ranks)): int(count) for name, ranks, count in rows}
    assert len(launches) == 7 * 4 and all(count >= 1 for count in launches.values()), run.stdout
    # A quantizer's or cast's chunks go to one launch per call at every rank count.
    for name in ("1-bit", "ternary", "fp16", "bf16"):
        assert launches[name, 8] == launches[name, 1], run.stdout
    # bench/cuda/bucket.cc, which times the same on a GPU: it runs, a row per compressor and rank count.
    run = subprocess.run([str(build / "bench_cuda_bucket_emu"), "--bucket-mib=0.0625", "--reps=1"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.count("\n| ") == 4 * 5 + 1, run.stdout[-3000:] + run.stderr[-3000:]
