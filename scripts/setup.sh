#!/usr/bin/env bash
# Idempotent set-up: a virtual environment in .venv with torch 2.13.0 (the CPU build) and
# the build/test tools, then ddlcomm built against that torch, without build isolation
# (an isolated build would pull a second torch), installed in editable mode.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
# UCX headers for the optional UCX transport (DDLCOMM_TRANSPORT=ucx): best effort, as root
# where apt-get exists; without them the build simply leaves the UCX transport out.
if ! pkg-config --exists ucx 2>/dev/null && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  { DEBIAN_FRONTEND=noninteractive apt-get install -y -q libucx-dev ucx-utils pkg-config >/dev/null 2>&1 ||
    { apt-get update -q >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q libucx-dev ucx-utils pkg-config >/dev/null 2>&1; }; } ||
    echo "setup: libucx-dev could not be installed; building without the UCX transport" >&2
fi
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
if ! .venv/bin/python -c "import torch, numpy, pytest, hypothesis, scikit_build_core" >/dev/null 2>&1; then
  echo "setup: installing torch 2.13.0 (CPU) and the build and test tools into .venv (a few minutes, once)"
  .venv/bin/pip install -q --upgrade pip
  .venv/bin/pip install -q torch==2.13.0 numpy pytest hypothesis "scikit-build-core>=0.10" ninja cmake matplotlib scikit-learn
fi
# Editable: the checkout itself is the package (its compiled extension is found through the
# install), so Python run in the checkout's root, or `-m ddlcomm.bench...`, imports it as is.
if [ -d build ]; then
  echo "setup: building ddlcomm (incremental: seconds to a few minutes)"
else
  echo "setup: building ddlcomm's C++ extension (the first build takes 10-15 min on 2 cores; later ones are incremental)"
fi
.venv/bin/pip install -q --no-build-isolation -e .
.venv/bin/python - <<'PY'
import torch, ddlcomm
print(f"ddlcomm ready: torch {torch.__version__}, backend registered: {ddlcomm.is_available()}")
PY
