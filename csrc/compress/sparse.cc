// What top-k and random-k share: their payload (uint32 indices ascending, then float32
// values or top-k's value codes), encoded codes, decoded, merge-summed across payloads, and
// validated.
#include <algorithm>
#include <array>
#include <vector>

#include "common/error.h"
#include "common/half.h"
#include "compress/bits.h"
#include "compress/block_sum.h"
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
  auto indexAt = [&](size_t j) { return in[j].index(cursors[j].at); };
  while (true) {
    size_t next = end;
    for (size_t j = 0; j < in.size(); ++j) {
      if (cursors[j].at < cursors[j].end) next = std::min<size_t>(next, indexAt(j));
    }
    if (next == end) return;
    float sum = 0.f;
    for (size_t j = 0; j < in.size(); ++j) {
      if (cursors[j].at < cursors[j].end && indexAt(j) == next) {
        sum += in[j].value(cursors[j].at);
        ++cursors[j].at;
      }
    }
    if (factor != 1.f) sum *= factor;
    out[next] = E::store(sum);
  }
}

// Bins [lo, hi) of the entries at ranks [first(lo), first(hi)) of order (ascending = rank
// order), by recursive selection: O(k log L), where sorting all k would be O(k log k).
void assignBins(uint64_t* begin, uint64_t* end, size_t lo, size_t hi, size_t k, size_t levels, uint8_t* bin) {
  auto first = [&](size_t b) { return (b * k + levels - 1) / levels; };  // ceil(b k / L): bin b's first rank
  if (hi - lo == 1) {
    for (uint64_t* e = begin; e != end; ++e) bin[uint32_t(*e)] = uint8_t(lo);
    return;
  }
  const size_t mid = (lo + hi) / 2;
  uint64_t* split = begin + (first(mid) - first(lo));
  std::nth_element(begin, split, end);
  assignBins(begin, split, lo, mid, k, levels, bin);
  assignBins(split, end, mid, hi, k, levels, bin);
}

}  // namespace

void encodeValueCodes(size_t k, unsigned valueBits, const uint8_t* indices, const float* y, float* residual,
                      uint8_t* table, uint8_t* codes) {
  const size_t levels = size_t(1) << (valueBits - 1);
  // Rank by magnitude, ties to the lower index (the entries are in index order): a total order,
  // ascending in (~|y| bits, entry).
  std::vector<uint64_t> order(k);
  for (size_t e = 0; e < k; ++e) order[e] = uint64_t(~magnitudeBits(y[e])) << 32 | e;
  std::vector<uint8_t> code(k);
  if (k > 0) assignBins(order.data(), order.data() + k, 0, levels, k, levels, code.data());
  for (size_t e = 0; e < k; ++e) code[e] = uint8_t(code[e] + (y[e] >= 0.f ? 0 : levels));
  // Each code's sum in float64 lanes, in the block sums' order (compress.h): parallel on a GPU.
  std::vector<std::array<double, kLanes>> lanes(2 * levels, std::array<double, kLanes>{});
  std::vector<uint64_t> count(2 * levels, 0);
  for (size_t e = 0; e < k; ++e) {
    lanes[code[e]][e % kLanes] += double(y[e]);
    ++count[code[e]];
  }
  std::vector<float> decoded(2 * levels);
  for (size_t c = 0; c < decoded.size(); ++c) {
    std::array<double, kLanes>& t = lanes[c];
    for (size_t width = kLanes / 2; width > 0; width /= 2) {
      for (size_t j = 0; j < width; ++j) t[j] += t[j + width];
    }
    decoded[c] = count[c] == 0 ? 0.f : float(t[0] / double(count[c]));
    storeLE(table + 4 * c, decoded[c]);
  }
  std::fill(codes, codes + (k * valueBits + 7) / 8, uint8_t(0));
  for (size_t e = 0; e < k; ++e) codes[e * valueBits / 8] |= uint8_t(code[e] << (e * valueBits % 8));
  if (residual == nullptr) return;
  for (size_t e = 0; e < k; ++e) residual[loadLE<uint32_t>(indices + 4 * e)] = residualOf(y[e], decoded[code[e]]);
}

void decodeSparse(size_t numel, const SparseSection& in, const Output& out) {
  if (!out.accumulate) parallelFor(numel, 1, kAlign, [&](size_t begin, size_t end) { fillZero(out, begin, end); });
  withSink(out, [&](auto sink) {
    for (size_t e = 0; e < in.k; ++e) sink(in.index(e), in.value(e));
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
