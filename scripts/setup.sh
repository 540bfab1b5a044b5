#!/usr/bin/env bash
# Idempotent set-up: a virtual environment in .venv with torch 2.13.0 (the CPU build) and
# the build/test tools, then ddlcomm built against that torch, without build isolation
# (an isolated build would pull a second torch), installed in editable mode.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
if ! .venv/bin/python -c "import torch, numpy, pytest, hypothesis, scikit_build_core" >/dev/null 2>&1; then
  .venv/bin/pip install -q --upgrade pip
  .venv/bin/pip install -q torch==2.13.0 numpy pytest hypothesis "scikit-build-core>=0.10" ninja cmake matplotlib scikit-learn
fi
# Editable: the checkout itself is the package (its compiled extension is found through the
# install), so Python run in the checkout's root, or `-m ddlcomm.bench...`, imports it as is.
.venv/bin/pip install -q --no-build-isolation -e .
.venv/bin/python - <<'PY'
import torch, ddlcomm
print(f"ddlcomm ready: torch {torch.__version__}, backend registered: {ddlcomm.is_available()}")
PY
