#!/usr/bin/env bash
# Idempotent set-up: the system packages the demo and the tests use, a virtual environment in
# .venv with torch 2.13.0 (the CPU build) and the build/test tools, then ddlcomm built against
# that torch, without build isolation (an isolated build would pull a second torch), installed
# in editable mode.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

# System packages, installed as root where apt-get exists; elsewhere one line says what is
# missing and what goes without it:
#   libucx-dev ucx-utils pkg-config: the UCX transport (DDLCOMM_TRANSPORT=ucx; else built without it)
#   iproute2: ip and tc, the emulated network's namespaces, links and rates (ddlcomm.slownet)
#   iptables: its delay and loss on kernels without the netem qdisc
#   libtcmalloc-minimal4: the allocator the FSDP2 step benchmark gives each rank by default
missing=()
pkg-config --exists ucx 2>/dev/null || missing+=(libucx-dev ucx-utils pkg-config)
{ command -v ip && command -v tc; } >/dev/null 2>&1 || missing+=(iproute2)
command -v iptables >/dev/null 2>&1 || missing+=(iptables)
ldconfig -p 2>/dev/null | grep -q libtcmalloc_minimal || missing+=(libtcmalloc-minimal4)
if [ ${#missing[@]} -gt 0 ]; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    echo "setup: installing system packages: ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    install() { apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null 2>&1; }
    install || { apt-get update -q >/dev/null 2>&1 && install; } ||
      echo "setup: could not install ${missing[*]}: without them the UCX transport is left out and the emulated network may lack delay" >&2
  else
    echo "setup: missing system packages (install them as root): ${missing[*]}; until then the UCX transport is left out and the emulated network (ddlcomm.slownet) may not run" >&2
  fi
fi

if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
if ! .venv/bin/python -c "import torch, numpy, pytest, hypothesis, scikit_build_core, matplotlib, sklearn, lightning, accelerate, transformers" >/dev/null 2>&1; then
  echo "setup: installing torch 2.13.0 (CPU) and the build and test tools into .venv (a few minutes, once)"
  .venv/bin/pip install -q --upgrade pip
  # The trainers the integration tests run (tests/test_trainers.py, tests/test_lightning.py), pinned;
  # torch==2.13.0 in the same command keeps pip from resolving another torch for them.
  .venv/bin/pip install -q torch==2.13.0 numpy pytest hypothesis "scikit-build-core>=0.10" ninja cmake matplotlib scikit-learn \
    lightning==2.6.0 accelerate==1.15.0 transformers==5.24.0
fi
# torchft (tests/test_torchft.py, bench/torchft_diloco.py): its wheel and the packages it imports,
# each with --no-deps, since torchft's own requirements would replace the CPU torch above.
if ! .venv/bin/python -c "import torchft.manager" >/dev/null 2>&1; then
  echo "setup: installing torchft and its opentelemetry packages into .venv (--no-deps: torch stays as it is)"
  # The versions checked together (those of 2026-11); import torchft.manager needs each of them.
  .venv/bin/pip install -q --no-deps torchft==0.2.0 opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 \
    opentelemetry-semantic-conventions==0.66b2 opentelemetry-proto==1.45.2 \
    opentelemetry-exporter-otlp-proto-common==1.45.2 opentelemetry-exporter-otlp-proto-http==1.45.2 \
    opentelemetry-exporter-otlp-common==0.66b2 opentelemetry-exporter-http-transport==0.66b2 protobuf==7.36.2
fi
# Editable: the checkout itself is the package (its compiled extension is found through the
# install), so Python run in the checkout's root (the benchmarks, `python -m bench.NAME`)
# imports it as is.
# The extras (plots, test) are already there: pip only records them.
if [ -d build ]; then
  echo "setup: building ddlcomm (incremental: seconds to a few minutes)"
else
  echo "setup: building ddlcomm's C++ extension (the first build takes a few minutes on 2 cores; later ones are incremental)"
fi
.venv/bin/pip install -q --no-build-isolation -e ".[plots,test]"
.venv/bin/python - <<'PY'
import torch, ddlcomm
print(f"ddlcomm ready: torch {torch.__version__}, backend registered: {ddlcomm.is_available()}")
PY
