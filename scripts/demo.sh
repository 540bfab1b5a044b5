#!/usr/bin/env bash
# The main job: a short multi-rank demo on this machine. torchrun with 2 and 4 local ranks,
# all-reduce on ddlcomm and gloo side by side, then DDP training on ddlcomm, uncompressed and
# through two compressed hooks (traffic saved, time per step, accuracy).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
cd "$(mktemp -d)"  # run against the installed package
export OMP_NUM_THREADS=1
for n in 2 4; do
  echo "== all-reduce, $n ranks: gloo and ddlcomm over each of its transports"
  "$OLDPWD/.venv/bin/torchrun" --standalone --nproc-per-node "$n" -m ddlcomm.bench.collectives \
    --ops all_reduce --budget 0.3 2>&1 | grep -v -e "^W[0-9]" -e OMP_NUM_THREADS -e '^\*\*\*'
done
echo "== DDP training on ddlcomm, 4 ranks: plain all-reduce, then the 1-bit and ternary hooks"
"$OLDPWD/.venv/bin/torchrun" --standalone --nproc-per-node 4 -m ddlcomm.examples.ddp_demo \
  2>&1 | grep -v -e "^W[0-9]" -e OMP_NUM_THREADS -e '^\*\*\*'
