// Blocks are walked in rows of 32 elements: row r of a block holds its elements 32r .. 32r+31,
// element j of a row feeds lane j. This is the summation order the cross-device contract
// fixes (compress.h): per-lane float32 sums in index order, then a fixed tree.
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace ddlcomm::compress {

constexpr size_t kLanes = 32;
using FullRow = std::integral_constant<size_t, kLanes>;

// Calls row(offset, n) for each row of a block of `len` elements: n is FullRow (a constant,
// so the compiler vectorizes the row) for all rows but a shorter last one.
template <class Fn>
[[gnu::always_inline]] inline void forEachRow(size_t len, Fn&& row) {
  size_t off = 0;
  for (; off + kLanes <= len; off += kLanes) row(off, FullRow{});
  if (off < len) row(off, len - off);
}

struct LaneSums {
  float lane[kLanes] = {};

  // The contract's tree: lane[j] += lane[j + 16], then +8, +4, +2, +1.
  float total() const {
    float t[kLanes];
    for (size_t j = 0; j < kLanes; ++j) t[j] = lane[j];
#pragma GCC unroll 5  // constant widths: each step becomes one vector add
    for (size_t width = kLanes / 2; width > 0; width /= 2) {
      for (size_t j = 0; j < width; ++j) t[j] += t[j + width];
    }
    return t[0];
  }
};

// Bit j of the result is pred(j), for j < n <= 32.
template <class N, class Pred>
[[gnu::always_inline]] inline uint32_t rowMask(N n, Pred&& pred) {
  uint32_t mask = 0;
  for (size_t j = 0; j < n; ++j) mask |= uint32_t(pred(j)) << j;
  return mask;
}

}  // namespace ddlcomm::compress
