#!/usr/bin/env bash
# The main job: a short multi-rank demo on this machine. torchrun with 2 and 4 local ranks,
# all-reduce on ddlcomm and gloo side by side, then DDP training on ddlcomm, uncompressed and
# through two compressed hooks (traffic saved, time per step, accuracy), on loopback and then
# across 4 emulated hosts joined by 100 Mbit/s links (network namespaces; skipped, with the
# reason, where the machine cannot make them).
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
RATE=100mbit DELAY=0.5ms
echo "== the same DDP training across 4 emulated hosts: one network namespace per rank, $RATE links, $DELAY delay"
if "$OLDPWD/.venv/bin/python" -m ddlcomm.bench.slownet --check; then
  "$OLDPWD/.venv/bin/python" -m ddlcomm.bench.slownet --ranks 4 --rate "$RATE" --delay "$DELAY" -- \
    "$OLDPWD/.venv/bin/python" -m ddlcomm.examples.ddp_demo --steps 100 2>&1 | sed -e '/cannot be retrieved/d' -e 's/^\[rank 0\] //'
else
  echo "   skipped: the slow-network part needs root, iproute2 (ip, tc) and network namespaces"
fi
