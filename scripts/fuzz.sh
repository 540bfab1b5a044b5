#!/usr/bin/env bash
# Builds the libFuzzer targets in fuzz/ with ASan + UBSan and runs each for a bounded time:
#   bash scripts/fuzz.sh [seconds-per-target] [target...]   (default 60 s; targets: frame payload)
# Each run starts from the committed corpus fuzz/corpus/<target> (seeds and regression inputs)
# plus what earlier runs found (build/fuzz/corpus/<target>, where new inputs go). Exits non-zero
# on any finding: crash, sanitizer report, unexpected exception, timeout, leak or out-of-memory;
# the reproducer is written to build/fuzz/<target>-crash-*, -timeout-*, -oom-*, -leak-*.
# Reproduce one: build/fuzz/<target>_fuzz <file>. See docs/fuzzing.md.
set -euo pipefail
cd "$(dirname "$0")/.."
SECONDS_PER_TARGET=${1:-60}
shift || true
TARGETS=("$@")
[ ${#TARGETS[@]} -gt 0 ] || TARGETS=(frame payload)
CXX=${FUZZ_CXX:-clang++-14}
OUT=build/fuzz

# clang and its libFuzzer/sanitizer runtimes (Debian 12: clang-14, libclang-rt-14-dev).
have_toolchain() {
  command -v "$CXX" >/dev/null 2>&1 &&
    echo 'extern "C" int LLVMFuzzerTestOneInput(const unsigned char*, unsigned long) { return 0; }' |
      "$CXX" -x c++ -fsanitize=fuzzer,address,undefined -o /dev/null - >/dev/null 2>&1
}
if ! have_toolchain; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "== installing clang-14 and libclang-rt-14-dev for the fuzz targets"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends clang-14 libclang-rt-14-dev >/dev/null
  fi
  if ! have_toolchain; then
    echo "fuzz.sh: $CXX with libFuzzer, ASan and UBSan is needed; install clang-14 and" \
      "libclang-rt-14-dev (apt-get install clang-14 libclang-rt-14-dev) or set FUZZ_CXX" >&2
    exit 1
  fi
fi

# The parsers and what they call; no torch. DDLCOMM_MULTIVERSION (common/half.h) is off under clang.
SOURCES=(csrc/common/error.cc csrc/common/dtype.cc csrc/transport/frame.cc csrc/compress/*.cc)
FLAGS=(-std=c++17 -O1 -g -pthread -Icsrc -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined)
mkdir -p "$OUT/obj"
echo "== building fuzz targets with $CXX (ASan, UBSan, libFuzzer)"
ALL=("${SOURCES[@]}")
for t in "${TARGETS[@]}"; do ALL+=("fuzz/${t}_fuzz.cc"); done
printf '%s\n' "${ALL[@]}" | xargs -P 2 -I{} sh -c "$CXX ${FLAGS[*]} -c {} -o $OUT/obj/\$(basename {} .cc).o"
OBJECTS=()
for src in "${SOURCES[@]}"; do OBJECTS+=("$OUT/obj/$(basename "$src" .cc).o"); done

status=0
for t in "${TARGETS[@]}"; do
  "$CXX" "${FLAGS[@]}" "$OUT/obj/${t}_fuzz.o" "${OBJECTS[@]}" -o "$OUT/${t}_fuzz"
  mkdir -p "$OUT/corpus/$t"
  case $t in
    frame) max_len=40 ;;  # the header; more bytes are ignored
    *) max_len=2048 ;;
  esac
  log="$OUT/$t.log"
  echo "== fuzzing $t for ${SECONDS_PER_TARGET}s (log: $log)"
  # One process; per-input limits: 10 s, 1 GiB RSS, no single allocation over 256 MiB.
  if UBSAN_OPTIONS=print_stacktrace=1 "$OUT/${t}_fuzz" -max_total_time="$SECONDS_PER_TARGET" -max_len="$max_len" -timeout=10 \
    -rss_limit_mb=1024 -malloc_limit_mb=256 -print_final_stats=1 -artifact_prefix="$OUT/$t-" \
    "$OUT/corpus/$t" "fuzz/corpus/$t" >"$log" 2>&1; then
    done_line=$(grep -E '^#[0-9]+[[:space:]]+DONE' "$log" | tail -1 || true)
    if [ -z "$done_line" ]; then
      status=1
      echo "   FAILED: $t exited 0 but its log has no DONE line; see $log" >&2
      continue
    fi
    execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log")
    rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log")
    echo "   ok: $execs execs, $rate exec/s, ${done_line#*DONE   }"
  else
    status=1
    echo "   FINDING in $t: reproducer $(ls -t "$OUT/$t"-* 2>/dev/null | head -1)" >&2
    tail -n 40 "$log" >&2
  fi
done
exit $status
