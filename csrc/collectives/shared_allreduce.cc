// All-reduce through the shared-memory windows of ranks on one host. Small buffers: every
// rank copies its input into its window and reduces all windows itself (one
// synchronisation). Large ones, a window at a time: each rank reduces its slice
// from every window into its own, then copies the other slices out (two). Either way the
// inputs are combined in rank order by exactly one arithmetic sequence per element, so
// every rank gets the same bits.
#include <algorithm>
#include <cstring>

#include "collectives/collectives.h"
#include "reduce/reduce.h"

namespace ddlcomm::shared {
namespace {

// Slices are reduced through a block that stays in L1 while every window's part is added.
constexpr size_t kBlockBytes = 16 * 1024;

void oneShot(Call& call, SharedWindows& w, char* data, size_t count, DataType dtype, ReduceOp op) {
  const int n = call.comm().size(), r = call.comm().rank();
  const size_t bytes = count * elementSize(dtype);
  const int half = w.nextHalf();
  std::memcpy(w.window(r, half), data, bytes);
  w.sync(call.signature(), bytes, call.deadline());
  if (r != 0) std::memcpy(data, w.window(0, half), bytes);
  for (int p = 1; p < n; ++p) reduceInto(op, dtype, data, w.window(p, half), count);
  if (op == ReduceOp::Avg) divideBy(dtype, data, count, double(n));
}

void twoPhase(Call& call, SharedWindows& w, char* data, size_t count, DataType dtype, ReduceOp op) {
  const int n = call.comm().size(), r = call.comm().rank();
  const size_t es = elementSize(dtype), bytes = count * es;
  const int half = w.nextHalf();
  // The peers read every slice of this rank's input but its own, which it reads in place.
  const ring::Chunks slices{count, n};
  const size_t mineBegin = slices.begin(r) * es, mineEnd = mineBegin + slices.length(r) * es;
  std::memcpy(w.window(r, half), data, mineBegin);
  std::memcpy(w.window(r, half) + mineEnd, data + mineEnd, bytes - mineEnd);
  w.sync(call.signature(), bytes, call.deadline());

  const size_t blockCount = std::max<size_t>(1, kBlockBytes / es);
  char* block = call.comm().scratch(blockCount * es, 0);
  for (size_t begin = slices.begin(r), end = begin + slices.length(r); begin < end; begin += blockCount) {
    const size_t m = std::min(blockCount, end - begin), offset = begin * es;
    auto input = [&](int p) { return p == r ? data + offset : w.window(p, half) + offset; };
    std::memcpy(block, input(0), m * es);
    for (int p = 1; p < n; ++p) reduceInto(op, dtype, block, input(p), m);
    if (op == ReduceOp::Avg) divideBy(dtype, block, m, double(n));
    std::memcpy(w.window(r, half) + offset, block, m * es);  // read by the others after the sync
    std::memcpy(data + offset, block, m * es);
  }
  w.sync(call.signature(), bytes, call.deadline());
  for (int p = 0; p < n; ++p) {
    if (p == r) continue;
    const size_t offset = slices.begin(p) * es;
    std::memcpy(data + offset, w.window(p, half) + offset, slices.length(p) * es);
  }
}

}  // namespace

void allreduceInWindows(Call& call, SharedWindows& w, char* data, size_t count, DataType dtype, ReduceOp op) {
  const size_t es = elementSize(dtype), perFill = w.windowBytes() / es;
  if (count * es <= call.comm().options().sharedOneShotBytes && count <= perFill) {
    oneShot(call, w, data, count, dtype, op);
    return;
  }
  for (size_t begin = 0; begin < count; begin += perFill) {
    twoPhase(call, w, data + begin * es, std::min(perFill, count - begin), dtype, op);
  }
}

}  // namespace ddlcomm::shared
