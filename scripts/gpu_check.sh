#!/usr/bin/env bash
# One command for a GPU machine (python3 with a CUDA torch, nvcc, cmake; ninja optional):
# builds the extension against that torch (pip install --no-build-isolation -e ., in the
# background) and csrc/cuda standalone; runs the GPU test (all sizes, plus >2^31 elements);
# then tests/test_gpu.py and the DDP step benchmark (bench.cuda.ddp_step) on the
# extension; then the GPU test under compute-sanitizer memcheck on a reduced size set, the
# CUDA benchmark (with the 25 MB bucket on its own, and its chunks at 1-16 ranks) and the
# plain-torch comparison.
# Logs go to $1 (default ./gpu-results): summary.txt (every step with its exit status),
# env.txt, build.log, test.log, memcheck.log, bench.log, bench.csv, bucket.log, chunks.log,
# torch.log, extension.log, pytest.log, ddp_step.log, ddp_step.json (and _adamw: the same step with
# AdamW). Every step has a time limit.
#
#   scripts/gpu_check.sh [results-dir]        CUDA_ARCH=90 (default) picks the architecture
#   GPU_CHECK_SKIP="test memcheck" scripts/gpu_check.sh     leaves those steps out
#   GPU_CHECK_TEST_ARGS= scripts/gpu_check.sh                the kernel test without --large
#   GPU_CHECK_PYTEST_ARGS="-n 4" GPU_CHECK_PYTEST_LIMIT=300 scripts/gpu_check.sh   pytest arguments, time limit
set -u -o pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
RESULTS=${1:-./gpu-results}
mkdir -p "$RESULTS"
RESULTS=$(cd "$RESULTS" && pwd)
BUILD=${DDLCOMM_CUDA_BUILD_DIR:-$ROOT/build/cuda-gpu}
ARCH=${CUDA_ARCH:-90}
SUMMARY=$RESULTS/summary.txt
# nvcc and compute-sanitizer live in the toolkit's bin folder, which is not always on PATH.
for dir in /usr/local/cuda/bin /usr/local/cuda-13.0/bin; do
  if [ -d "$dir" ]; then PATH=$PATH:$dir; fi
done
export PATH
# The system compiler, whose libstdc++ is the one torch loads: a compiler that links its own
# libstdc++ statically (seen: /opt/gcc on the device image) gives the extension a second C++
# runtime beside torch's, and its first ostringstream crashes in the locale code.
if [ -x /usr/bin/g++ ]; then export CXX=/usr/bin/g++ CC=/usr/bin/gcc; fi
: >"$SUMMARY"
FAILED=0

note() { echo "[gpu_check $(date +%H:%M:%S)] $*" | tee -a "$SUMMARY"; }
skipped() { case " ${GPU_CHECK_SKIP:-} " in *" $1 "*) note "$1: skipped (GPU_CHECK_SKIP)"; return 0;; esac; return 1; }

# step NAME LIMIT_SECONDS LOG COMMAND...: runs COMMAND with a time limit, output to LOG.
step() {
  local name=$1 limit=$2 log=$3
  shift 3
  local start=$SECONDS
  note "$name: $*"
  timeout --kill-after=10 "$limit" "$@" >"$RESULTS/$log" 2>&1
  local rc=$?
  local tail_line
  tail_line=$(grep -E "passed, [0-9]+ failed|SKIP" "$RESULTS/$log" | tail -1)
  note "$name: exit $rc after $((SECONDS - start)) s${tail_line:+ — $tail_line} (log: $log)"
  if [ $rc -ne 0 ]; then FAILED=1; fi
  return $rc
}

{
  date
  uname -a
  nvidia-smi || true
  nvcc --version || true
  cmake --version || true
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available())" || true
  git -C "$ROOT" log -1 --oneline || true
} >"$RESULTS/env.txt" 2>&1

# The extension against this torch (architectures from TORCH_CUDA_ARCH_LIST), built while the
# kernels are tested: its own build folder, fresh each time (CMake keeps the compiler of a
# folder's first build).
EXTENSION=
if ! skipped extension; then
  rm -rf "$ROOT/build/gpu-extension"
  step extension 400 extension.log env TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-${ARCH:0:1}.${ARCH:1}}" \
    nice -n 10 python3 -m pip install --no-build-isolation --no-deps -C build-dir=build/gpu-extension -e "$ROOT" &
  EXTENSION=$!
fi

GENERATOR="Unix Makefiles"
if command -v ninja >/dev/null 2>&1; then GENERATOR=Ninja; fi
step build 300 build.log bash -c "cmake -S '$ROOT/csrc/cuda' -B '$BUILD' -G '$GENERATOR' -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_CUDA_ARCHITECTURES='$ARCH' && cmake --build '$BUILD' -j $(nproc)" || { note "build failed"; exit 1; }

# The test exits 0 (all passed), 1 (a failure) or 77 (no GPU).
skipped test || step test 240 test.log "$BUILD/test_cuda_kernels" ${GPU_CHECK_TEST_ARGS---large}
# Then the CUDA paths of the Python package (compress, the backend, compressed all-reduce, DDP
# hooks, FSDP2's compressed reduce-scatter) and the DDP step benchmark, on the extension.
if [ -n "$EXTENSION" ]; then
  if wait "$EXTENSION"; then
    skipped pytest || step pytest "${GPU_CHECK_PYTEST_LIMIT:-500}" pytest.log bash -c "cd /tmp && PYTHONUNBUFFERED=1 python3 -m pytest -q -rA \
      -p no:cacheprovider ${GPU_CHECK_PYTEST_ARGS:-} '$ROOT/tests/test_gpu.py'"
    skipped ddp_step || step ddp_step 200 ddp_step.log bash -c "cd '$ROOT' && PYTHONUNBUFFERED=1 python3 -m \
      bench.cuda.ddp_step --json '$RESULTS/ddp_step.json'"
    # The same with AdamW: the hooks average Adam's directions (ddlcomm.optim.AdamW).
    skipped ddp_step || step ddp_step_adamw 200 ddp_step_adamw.log bash -c "cd '$ROOT' && PYTHONUNBUFFERED=1 \
      python3 -m bench.cuda.ddp_step --optimizer adamw --json '$RESULTS/ddp_step_adamw.json'"
  else
    FAILED=1
  fi
fi


SANITIZER=$(command -v compute-sanitizer || ls /usr/local/cuda*/compute-sanitizer/compute-sanitizer \
  /opt/nvidia/*/compute-sanitizer/compute-sanitizer 2>/dev/null | head -1)
if skipped memcheck; then
  :
elif [ -n "$SANITIZER" ]; then
  step memcheck 200 memcheck.log "$SANITIZER" --tool memcheck --error-exitcode 99 --print-limit 20 \
    "$BUILD/test_cuda_kernels" --quick
else
  note "memcheck: compute-sanitizer not found, not run"
  FAILED=1
fi
skipped bench || step bench 150 bench.log "$BUILD/bench_cuda_kernels" --csv="$RESULTS/bench.csv"
# A 25 MB DDP bucket (24 MiB): encode+EF plus decode-accumulate against the 1 ms target.
skipped bucket || step bucket 60 bucket.log "$BUILD/bench_cuda_kernels" --min-mib=24 --max-mib=24
# The same bucket's kernels at 1-16 ranks, every rank's chunk in one call against a call per
# chunk: host and GPU time (bench/cuda/bucket.cc).
skipped chunks || step chunks 120 chunks.log "$BUILD/bench_cuda_bucket"
# By its path: it imports torch only.
skipped torch || step torch 150 torch.log env PYTHONUNBUFFERED=1 python3 "$ROOT/bench/cuda/torch_ops.py" \
  --bench "$BUILD/bench_cuda_kernels" --sizes-mib 1,16,64,256

note "done: $([ $FAILED -eq 0 ] && echo 'all steps passed' || echo 'SOME STEPS FAILED') (results in $RESULTS)"
echo
echo "== benchmark =="
cat "$RESULTS/bench.log" 2>/dev/null | tail -70
echo "== 25 MB bucket =="
tail -4 "$RESULTS/bucket.log" 2>/dev/null
echo "== a bucket's chunks together =="
tail -22 "$RESULTS/chunks.log" 2>/dev/null
echo "== torch comparison =="
tail -45 "$RESULTS/torch.log" 2>/dev/null
echo "== pytest =="
grep -E "ACCURACY|passed|failed|Error|error" "$RESULTS/pytest.log" 2>/dev/null | tail -30
echo "== DDP step =="
tail -12 "$RESULTS/ddp_step.log" 2>/dev/null
tail -12 "$RESULTS/ddp_step_adamw.log" 2>/dev/null
exit $FAILED
