#!/usr/bin/env bash
# The main job: a short multi-rank demo on this machine. torchrun with 2 and 4 local ranks,
# all-reduce on ddlcomm and gloo side by side, then DDP training on ddlcomm, uncompressed and
# through two compressed hooks (traffic saved, time per step, accuracy), on loopback and then
# across 4 emulated hosts joined by 100 Mbit/s links (network namespaces; skipped, with the
# reason, where the machine cannot make them).
#
# --short: every part, in seconds rather than minutes (2 ranks, few sizes and steps): what CI
# runs (scripts/test.sh) so that the front door is exercised on every change.
set -euo pipefail
cd "$(dirname "$0")/.."
SHORT=0
case "${1:-}" in
  --short) SHORT=1 ;;
  "") ;;
  *) echo "usage: bash scripts/demo.sh [--short]" >&2; exit 2 ;;
esac
bash scripts/setup.sh
VENV="$PWD/.venv/bin"
# The benchmarks (bench/) run from the repository root, where `-m bench.NAME` finds them;
# ddlcomm is the editable install setup.sh made.
export OMP_NUM_THREADS=1
quiet() { grep -v -e "^W[0-9]" -e OMP_NUM_THREADS -e '^\*\*\*' || true; }
if [ "$SHORT" = 1 ]; then
  RANKS="2" BENCH=(--sizes 4096,1048576 --budget 0.05) STEPS=(--steps 30) SLOW_STEPS=(--steps 20) DDP_RANKS=2
else
  RANKS="2 4" BENCH=(--budget 0.3) STEPS=() SLOW_STEPS=(--steps 100) DDP_RANKS=4
fi
for n in $RANKS; do
  echo "== all-reduce, $n ranks: gloo and ddlcomm over each of its transports"
  "$VENV/torchrun" --standalone --nproc-per-node "$n" -m bench.collectives \
    --ops all_reduce "${BENCH[@]}" 2>&1 | quiet
done
echo "== DDP training on ddlcomm, $DDP_RANKS ranks: plain all-reduce, then the 1-bit and ternary hooks"
"$VENV/torchrun" --standalone --nproc-per-node "$DDP_RANKS" -m bench.ddp_demo "${STEPS[@]}" 2>&1 | quiet
RATE=100mbit DELAY=0.5ms
echo "== the same DDP training across 4 emulated hosts: one network namespace per rank, $RATE links, $DELAY delay"
# --check answers for this rate and delay, by the choice the run itself makes.
if check=$("$VENV/python" -m ddlcomm.slownet --check --rate "$RATE" --delay "$DELAY"); then
  echo "   $check"
  "$VENV/python" -m ddlcomm.slownet --ranks 4 --rate "$RATE" --delay "$DELAY" -- \
    "$VENV/python" -m bench.ddp_demo "${SLOW_STEPS[@]}" 2>&1 | sed -e '/cannot be retrieved/d' -e 's/^\[rank 0\] //'
else
  echo "   skipped: ${check#slownet: }"
fi
