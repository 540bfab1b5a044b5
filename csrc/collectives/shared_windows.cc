// Collectives through the shared-memory windows of ranks on one host, a window at a time:
// what each rank reads of another's input is copied into that rank's window once and read
// there by every rank that needs it, with no message and no copy through a ring.
//
// All-reduce. Small buffers: every rank copies its input into its window and reduces all
// windows itself (one synchronisation). Large ones: each rank reduces its slice from every
// window into its own, then copies the other slices out (two).
// Reduce-scatter: each rank copies the other ranks' chunks of its input into its window, then
// reduces its own chunk from every window (one synchronisation a fill).
// All-gather: each rank copies its input into its window, then every window out (one).
// Reductions combine the inputs in rank order by exactly one arithmetic sequence per element,
// so every rank gets the same bits.
#include <algorithm>
#include <cstring>

#include "collectives/collectives.h"
#include "reduce/reduce.h"

namespace ddlcomm::shared {
namespace {

// Slices are reduced through a block that stays in L1 while every window's part is added.
constexpr size_t kBlockBytes = 16 * 1024;

// `out` (m elements) = the rows input(0..n-1) combined in rank order (with Avg, divided by n).
// `out` may be one of the rows: each block is read whole before it is written.
template <class Input>
void reduceRows(Call& call, char* out, size_t m, int n, Input input, DataType dtype, ReduceOp op) {
  const size_t es = elementSize(dtype), blockCount = std::max<size_t>(1, kBlockBytes / es);
  char* block = call.comm().scratch(blockCount * es, 0);
  for (size_t done = 0; done < m; done += blockCount) {
    const size_t k = std::min(blockCount, m - done), offset = done * es;
    std::memcpy(block, input(0) + offset, k * es);
    for (int p = 1; p < n; ++p) reduceInto(op, dtype, block, input(p) + offset, k);
    if (op == ReduceOp::Avg) divideBy(dtype, block, k, double(n));
    std::memcpy(out + offset, block, k * es);
  }
}

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

  reduceRows(call, data + mineBegin, slices.length(r), n,
             [&](int p) { return (p == r ? data : w.window(p, half)) + mineBegin; }, dtype, op);
  // Read by the others after the sync.
  std::memcpy(w.window(r, half) + mineBegin, data + mineBegin, mineEnd - mineBegin);
  w.sync(call.signature(), bytes, call.deadline());
  for (int p = 0; p < n; ++p) {
    if (p == r) continue;
    const size_t offset = slices.begin(p) * es;
    std::memcpy(data + offset, w.window(p, half) + offset, slices.length(p) * es);
  }
}

}  // namespace

bool windowsFit(const SharedWindows& w, int n, DataType dtype) {
  return w.windowBytes() >= size_t(n) * elementSize(dtype);
}

void reduceScatterInWindows(Call& call, SharedWindows& w, const char* input, char* output, size_t count,
                            DataType dtype, ReduceOp op) {
  const int n = call.comm().size(), r = call.comm().rank();
  const size_t es = elementSize(dtype), perFill = w.windowBytes() / (size_t(n) * es);
  for (size_t begin = 0; begin < count; begin += perFill) {
    const size_t m = std::min(perFill, count - begin);
    const int half = w.nextHalf();
    // Slot q of this rank's window: elements [begin, begin + m) of chunk q of its input, for
    // rank q to reduce; its own chunk it reads in place.
    for (int q = 0; q < n; ++q) {
      if (q != r) std::memcpy(w.window(r, half) + size_t(q) * m * es, input + (size_t(q) * count + begin) * es, m * es);
    }
    w.sync(call.signature(), size_t(n) * m * es, call.deadline());
    const char* own = input + (size_t(r) * count + begin) * es;
    reduceRows(call, output + begin * es, m, n,
               [&](int p) { return p == r ? own : w.window(p, half) + size_t(r) * m * es; }, dtype, op);
  }
}

void allgatherInWindows(Call& call, SharedWindows& w, const char* input, char* output, size_t count,
                        DataType dtype) {
  const int n = call.comm().size(), r = call.comm().rank();
  const size_t es = elementSize(dtype), perFill = w.windowBytes() / es;
  char* mine = output + size_t(r) * count * es;
  if (mine != input) std::memmove(mine, input, count * es);
  for (size_t begin = 0; begin < count; begin += perFill) {
    const size_t m = std::min(perFill, count - begin);
    const int half = w.nextHalf();
    std::memcpy(w.window(r, half), mine + begin * es, m * es);
    w.sync(call.signature(), m * es, call.deadline());
    for (int p = 0; p < n; ++p) {
      if (p != r) std::memcpy(output + (size_t(p) * count + begin) * es, w.window(p, half), m * es);
    }
  }
}

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
