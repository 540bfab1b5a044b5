// What top-k and random-k share: their payload (uint32 indices ascending, then float32
// values), decoded, merge-summed across payloads, and validated.
#include <algorithm>
#include <vector>

#include "common/error.h"
#include "common/half.h"
#include "compress/bits.h"
#include "compress/kernels.h"
#include "compress/parallel.h"

namespace ddlcomm::compress {
namespace {

// Part boundaries of the passes over the output, in elements.
constexpr size_t kAlign = 4096;

DDLCOMM_MULTIVERSION void fillZero(const Output& out, size_t begin, size_t end) {
  withSink(out, [&](auto sink) __attribute__((always_inline)) {
    for (size_t i = begin; i < end; ++i) sink(i, 0.f);
  });
}

// First position in indices[0, k) whose index is >= i.
size_t lowerBound(const uint8_t* indices, size_t k, size_t i) {
  size_t lo = 0, hi = k;
  while (lo < hi) {
    const size_t mid = lo + (hi - lo) / 2;
    if (loadLE<uint32_t>(indices + 4 * mid) < i) lo = mid + 1; else hi = mid;
  }
  return lo;
}

// A merge of the payloads' sorted index lists over indices [begin, end): each index any
// payload carries gets its values summed in payload order from +0, times factor.
template <class E>
void sumRange(const std::vector<SparseSection>& in, float factor, typename E::Raw* out, size_t begin, size_t end) {
  struct Cursor {
    size_t at, end;
  };
  std::vector<Cursor> cursors;
  for (const SparseSection& s : in) cursors.push_back({lowerBound(s.indices, s.k, begin), lowerBound(s.indices, s.k, end)});
  auto indexAt = [&](size_t j) { return loadLE<uint32_t>(in[j].indices + 4 * cursors[j].at); };
  while (true) {
    size_t next = end;
    for (size_t j = 0; j < in.size(); ++j) {
      if (cursors[j].at < cursors[j].end) next = std::min<size_t>(next, indexAt(j));
    }
    if (next == end) return;
    float sum = 0.f;
    for (size_t j = 0; j < in.size(); ++j) {
      if (cursors[j].at < cursors[j].end && indexAt(j) == next) {
        sum += loadLE<float>(in[j].values + 4 * cursors[j].at);
        ++cursors[j].at;
      }
    }
    if (factor != 1.f) sum *= factor;
    out[next] = E::store(sum);
  }
}

}  // namespace

void decodeSparse(size_t numel, size_t k, const uint8_t* indices, const uint8_t* values, const Output& out) {
  if (!out.accumulate) parallelFor(numel, 1, kAlign, [&](size_t begin, size_t end) { fillZero(out, begin, end); });
  withSink(out, [&](auto sink) {
    for (size_t e = 0; e < k; ++e) sink(loadLE<uint32_t>(indices + 4 * e), loadLE<float>(values + 4 * e));
  });
}

void sumSections(const std::vector<SparseSection>& in, size_t numel, float factor, DataType outType, void* out) {
  size_t entries = 0;
  for (const SparseSection& s : in) entries += s.k;
  runParts(threadsFor(entries), numel, kAlign, [&](size_t, size_t begin, size_t end) {
    switch (outType) {
      case DataType::Float16: return sumRange<F16>(in, factor, static_cast<uint16_t*>(out), begin, end);
      case DataType::BFloat16: return sumRange<BF16>(in, factor, static_cast<uint16_t*>(out), begin, end);
      default: return sumRange<F32>(in, factor, static_cast<float*>(out), begin, end);
    }
  });
}

void checkSparseIndices(const uint8_t* indices, size_t k, size_t numel) {
  for (size_t e = 0; e < k; ++e) {
    const uint32_t index = loadLE<uint32_t>(indices + 4 * e);
    DDLCOMM_CHECK(index < numel, ErrorKind::Protocol, "sparse payload: index ", index, " at position ", e,
                  " is out of range for ", numel, " elements");
    DDLCOMM_CHECK(e == 0 || index > loadLE<uint32_t>(indices + 4 * (e - 1)), ErrorKind::Protocol,
                  "sparse payload: indices are not strictly increasing at position ", e);
  }
}

}  // namespace ddlcomm::compress
