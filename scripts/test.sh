#!/usr/bin/env bash
# The test command (README, .ci/run): set up, the CUDA code's compile checks (where nvcc is),
# the front door (the README's main command in its short form), fuzzing, then the whole suite
# in two steps: the trainer integrations and the long benchmark-like tests (marked slow) apart.
# pytest's exit status is the script's, so "no tests collected" (exit 5) fails too.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"  # cmake and ninja from the venv
# The CUDA kernels compile wherever nvcc exists, GPU or not (they run on a GPU machine).
if command -v nvcc >/dev/null 2>&1 && [ -f csrc/cuda/CMakeLists.txt ]; then
  echo "== compiling the CUDA kernels (standalone, no GPU needed)"
  cmake -S csrc/cuda -B build/cuda -G Ninja >/dev/null
  ninja -C build/cuda
  # The extension's CUDA-only code (#ifdef DDLCOMM_WITH_CUDA: the compressed collectives' CUDA
  # branches, the CUDA bindings) builds only against a CUDA torch; against this torch's headers
  # and CUDA's, a compile error in it shows here rather than on a GPU machine.
  echo "== checking the extension's CUDA-only code (syntax, against torch's and CUDA's headers)"
  .venv/bin/python - <<'PY'
import os, subprocess, sys, sysconfig
import torch
torch_dir = os.path.dirname(torch.__file__)
cuda = os.environ.get("CUDA_HOME", "/usr/local/cuda")
files = sorted(os.path.join(d, f) for d, _, fs in os.walk("csrc") if not d.startswith("csrc/cuda")
               for f in fs if f.endswith(".cc") and "DDLCOMM_WITH_CUDA" in open(os.path.join(d, f)).read())
flags = ["-std=c++17", "-fsyntax-only", "-w", "-DDDLCOMM_WITH_CUDA=1",
         f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}", "-Icsrc",
         f"-I{torch_dir}/include", f"-I{torch_dir}/include/torch/csrc/api/include", f"-I{cuda}/include",
         f"-I{sysconfig.get_paths()['include']}"]
for f in files:
    print("  ", f, flush=True)
    if subprocess.call([os.environ.get("CXX", "g++"), *flags, f]) != 0:
        sys.exit(f"{f}: its CUDA-only code does not compile")
PY
fi
# The CUDA kernels' CPU-emulator test program (tests/test_cuda_emulator.py runs it): a build
# step, so it is done here, outside pytest's time; the test rebuilds it if it is stale.
echo "== compiling the CUDA kernels' CPU-emulator test"
cmake -S tests/cuda/emu -B build/cuda-emu -G Ninja >/dev/null
ninja -C build/cuda-emu
# The main command as a new user runs it, every part in seconds (a part that cannot run here
# is skipped with its reason, and the demo still exits 0).
echo "== scripts/demo.sh --short"
bash scripts/demo.sh --short
# libFuzzer with ASan/UBSan on the frame and payload parsers, ~30 s per target (docs/fuzzing.md).
bash scripts/fuzz.sh 30
if [ $# -gt 0 ]; then  # the caller chose the tests (and markers): one run
  echo "== pytest $*"
  exec .venv/bin/pytest -q --durations=40 "$@"
fi
echo "== pytest -m \"not trainers and not slow\""
.venv/bin/pytest -q --durations=40 -m "not trainers and not slow"
# The trainer integrations (Lightning, Accelerate, the Hugging Face Trainer: tests/test_trainers.py,
# tests/test_lightning.py) and the long benchmark-like tests (a benchmark's shortest form of
# over ten seconds, torchft's restarts) as a step of their own, so that a failure there is told
# apart and the main step stays well inside its time.
echo "== pytest -m \"trainers or slow\""
exec .venv/bin/pytest -q --durations=20 -m "trainers or slow"
