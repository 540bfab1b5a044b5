#!/usr/bin/env bash
# The extension built against a CUDA build of torch on a machine without a GPU: a venv of its
# own (the project's .venv keeps its CPU torch), the working tree copied there and installed
# editable with DDLCOMM_WITH_CUDA, imported, and the CPU tests run on it (the CUDA ones skip).
# It shows what the syntax check in scripts/test.sh cannot: that the CUDA kernels and the
# extension's CUDA-only code compile and link against that torch, and that a CUDA build serves
# CPU tensors. Needs nvcc of the CUDA major torch was built with, and about 7 GB of disk.
#
#   scripts/cuda_build_check.sh [work-dir] [pytest arguments...]
#   TORCH_SPEC=torch==2.14.1 (default)   CUDA_HOME=/usr/local/cuda (default)   CUDA_ARCH=90 (default)
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
WORK=${1:-/tmp/ddlcomm-cuda-build}
shift $(($# > 0 ? 1 : 0))
CUDA=${CUDA_HOME:-/usr/local/cuda}
export PATH=$CUDA/bin:$PATH
mkdir -p "$WORK"
WORK=$(cd "$WORK" && pwd)

echo "== a venv with ${TORCH_SPEC:=torch==2.14.1} in $WORK/venv"
[ -x "$WORK/venv/bin/python" ] || python3 -m venv "$WORK/venv"
"$WORK/venv/bin/pip" install -q "$TORCH_SPEC" numpy pytest hypothesis scikit-learn "scikit-build-core>=0.10" ninja cmake
"$WORK/venv/bin/python" -c "import sys, torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda)
sys.exit(0 if torch.version.cuda else 'torch is not a CUDA build')"

echo "== the working tree, copied to $WORK/src"
rm -rf "$WORK/src" && mkdir -p "$WORK/src"
git -C "$ROOT" ls-files -z --cached --others --exclude-standard | (cd "$ROOT" && tar --null -T - -cf -) |
  tar -xf - -C "$WORK/src"

echo "== building ddlcomm against it (editable; sm_${CUDA_ARCH:=90} only)"
# Torch's CMake config looks for the toolkit where nvcc is (give it the toolkit's root), and
# for nvrtc, which a toolkit from pip packages may lack: torch's own wheel brings one.
nvrtc=$(find "$WORK/venv/lib" -path "*nvidia*" -name "libnvrtc.so.*" | grep -v builtins | head -1)
args="-DCUDA_TOOLKIT_ROOT_DIR=$CUDA -DDDLCOMM_CUDA_ARCHS=$CUDA_ARCH"
if [ ! -e "$CUDA/lib64/libnvrtc.so" ] && [ -n "$nvrtc" ]; then args="$args -DCUDA_nvrtc_LIBRARY=$nvrtc"; fi
(cd "$WORK/src" && CMAKE_ARGS="$args" CXX=/usr/bin/g++ CC=/usr/bin/gcc \
  "$WORK/venv/bin/pip" install -q --no-build-isolation --no-deps -e .)
(cd "$WORK" && "$WORK/venv/bin/python" -c "import torch, ddlcomm, ddlcomm.compressors as c
print('ddlcomm', ddlcomm.__version__, 'on torch', torch.__version__, '- CUDA kernels linked:', c.has_cuda())
assert c.has_cuda(), 'the extension was built without its CUDA kernels'")

echo "== the tests, on the CPU"
cd "$WORK/src"
# The trainers and torchft are not installed there: their tests and their pages' examples run in
# the project's .venv.
skip=(--ignore=tests/test_trainers.py)
for page in accelerate huggingface lightning torchft; do
  skip+=(--deselect "tests/test_docs.py::test_python_block_runs[docs/$page.md:1]")
done
"$WORK/venv/bin/pytest" -q -p no:cacheprovider -m "not trainers and not slow" "${skip[@]}" "$@"
