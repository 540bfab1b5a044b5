// Top-k with error feedback: the payload carries the k entries of largest |y| (indices
// ascending, then values); every other element stays in the residual.
//
// Top-k ranks elements by magnitudeBits(y) (NaN largest), ties to the lower index, and keeps
// exactly k. Both paths end the same way: collect the candidates, all entries with key >= t for
// some t that at least k reach, and select exactly among them (nth_element). The exact path
// finds t with a radix histogram of the keys (usually one level, so two passes over y in all).
// The approximate path (Deep Gradient Compression) estimates t from a counter-based random
// sample and collects in the same pass that forms y (one pass). Whenever the sampled t leaves
// at least k candidates they contain the true top-k, so the result equals exact top-k bit for
// bit; with fewer than k (or too many to hold) it falls back to the exact path on the y already
// formed. The sample only decides how fast that is, never what is sent.
#include <algorithm>
#include <cmath>
#include <vector>

#include "common/half.h"
#include "compress/bits.h"
#include "compress/block_sum.h"
#include "compress/counter_random.h"
#include "compress/kernels.h"
#include "compress/parallel.h"

namespace ddlcomm::compress {
namespace {

using Key = uint32_t;  // magnitudeBits(y)
constexpr Key kInfinityKey = 0x7f800000;

struct Entry {
  uint32_t index;
  float value;
};

// ---- y = x + residual, tile by tile --------------------------------------------------------

// Elements per tile: small enough for L1, so a pass that forms y also consumes it from cache.
constexpr size_t kTile = 4096;

// y[begin, begin + n). With error feedback the first pass stores y into the residual
// (r = x + r: what stays there unless the element is sent) and later passes read it back.
// Without, y is x itself (float32) or x widened into `scratch`.
DDLCOMM_MULTIVERSION const float* loadTile(const Input& in, bool first, size_t begin, size_t n, float* scratch) {
  if (in.residual != nullptr) {
    if (first) {
      withElement(in.type, [&](auto e) __attribute__((always_inline)) {
        using E = decltype(e);
        const auto* x = static_cast<const typename E::Raw*>(in.x) + begin;
        float* r = in.residual + begin;
        for (size_t i = 0; i < n; ++i) r[i] = loadY<E, true>(x, r, i);
      });
    }
    return in.residual + begin;
  }
  if (in.type == DataType::Float32) return static_cast<const float*>(in.x) + begin;
  withElement(in.type, [&](auto e) __attribute__((always_inline)) {
    using E = decltype(e);
    const auto* x = static_cast<const typename E::Raw*>(in.x) + begin;
    for (size_t i = 0; i < n; ++i) scratch[i] = E::load(x[i]);
  });
  return scratch;
}

// Calls visit(begin, y, n) for the tiles of [begin, end).
template <class Visit>
void forEachTile(const Input& in, bool first, size_t begin, size_t end, Visit&& visit) {
  std::vector<float> scratch(in.residual == nullptr && in.type != DataType::Float32 ? kTile : 0);
  for (size_t i = begin; i < end; i += kTile) {
    const size_t n = std::min(kTile, end - i);
    visit(i, loadTile(in, first, i, n, scratch.data()), n);
  }
}

// ---- selection ------------------------------------------------------------------------------

// The k-th largest key, and how many entries with exactly that key are kept (lowest indices).
struct Threshold {
  Key key;
  size_t ties;
};

// Counts, into hist, the keys whose bits above `filterShift` equal `prefix`, by bits [shift, shift + width).
DDLCOMM_MULTIVERSION void histogram(const float* y, size_t n, unsigned filterShift, Key prefix, unsigned shift,
                                    Key width, uint64_t* hist) {
  const Key mask = (Key(1) << width) - 1;
  for (size_t i = 0; i < n; ++i) {
    const Key key = magnitudeBits(y[i]);
    if ((key >> filterShift) == prefix) ++hist[(key >> shift) & mask];
  }
}

// Result of the radix select: either the exact threshold, or a key `t` that at least k and at
// most `limit` entries reach (key >= t), among which the caller selects.
struct RadixResult {
  bool exact;
  Threshold threshold;  // exact: the k-th largest key and its ties; else {t, 0}
};

// Radix select of the k-th largest key (k >= 1) on the 31 key bits, 11 + 11 + 9 at a time: one
// histogram pass per level, restricted to the bucket that holds the k-th key so far. Stops as
// soon as the entries at or above that bucket are few enough to collect (typically after one
// level: a bucket spans 1/8 of an octave).
RadixResult radixSelect(const Input& in, size_t k, bool first, size_t limit) {
  struct Level {
    unsigned shift, width;
  };
  constexpr Level kLevels[] = {{20, 11}, {9, 11}, {0, 9}};
  Key prefix = 0;
  size_t need = k;  // entries still to take among those whose key starts with `prefix`
  for (const Level& level : kLevels) {
    const size_t buckets = size_t(1) << level.width;
    const size_t parts = threadsFor(in.numel);
    std::vector<uint64_t> hist(parts * buckets, 0);
    runParts(parts, in.numel, kTile, [&](size_t part, size_t begin, size_t end) {
      forEachTile(in, first, begin, end, [&](size_t, const float* y, size_t n) {
        histogram(y, n, level.shift + level.width, prefix, level.shift, level.width, &hist[part * buckets]);
      });
    });
    first = false;
    for (size_t part = 1; part < parts; ++part) {
      for (size_t b = 0; b < buckets; ++b) hist[b] += hist[part * buckets + b];
    }
    size_t bucket = buckets - 1;
    for (; hist[bucket] < need; --bucket) need -= hist[bucket];
    prefix = (prefix << level.width) | Key(bucket);
    if (level.shift > 0 && k - need + hist[bucket] <= limit) return {false, {prefix << level.shift, 0}};
  }
  return {true, {prefix, need}};
}

// Appends the entries of y[0, n) (element base + i) with key > t, or key == t while fewer than
// tieLimit of those were taken, as long as `out` holds fewer than `limit`. Returns how many
// qualified, appended or not.
DDLCOMM_MULTIVERSION size_t collect(const float* y, size_t n, size_t base, Key t, size_t tieLimit, size_t& ties,
                                    size_t limit, std::vector<Entry>& out) {
  size_t found = 0;
  forEachRow(n, [&](size_t off, auto rowLen) __attribute__((always_inline)) {
    uint32_t mask = rowMask(rowLen, [&](size_t j) __attribute__((always_inline)) {
      return magnitudeBits(y[off + j]) >= t;
    });
    for (; mask != 0; mask &= mask - 1) {
      const size_t i = off + size_t(__builtin_ctz(mask));
      if (magnitudeBits(y[i]) == t && ties++ >= tieLimit) continue;
      ++found;
      if (out.size() < limit) out.push_back({uint32_t(base + i), y[i]});
    }
  });
  return found;
}

// Collects, per part, the entries with key >= t (ties as in collect, at most `limit` kept per
// part); returns how many qualified in total.
size_t collectParts(const Input& in, bool first, Key t, size_t tieLimit, size_t limit,
                    std::vector<std::vector<Entry>>& parts) {
  parts.assign(threadsFor(in.numel), {});
  std::vector<size_t> found(parts.size(), 0);
  runParts(parts.size(), in.numel, kTile, [&](size_t part, size_t begin, size_t end) {
    size_t ties = 0;
    forEachTile(in, first, begin, end, [&](size_t base, const float* y, size_t n) {
      found[part] += collect(y, n, base, t, tieLimit, ties, limit, parts[part]);
    });
  });
  size_t total = 0;
  for (size_t f : found) total += f;
  return total;
}

// Zeroes the residual where it is not finite: after a top-k whose threshold is non-finite,
// the unsent non-finite entries (selected ones are already 0).
DDLCOMM_MULTIVERSION void clearNonFinite(float* residual, size_t begin, size_t end) {
  for (size_t i = begin; i < end; ++i) residual[i] = residualOf(residual[i], 0.f);
}

// Writes the entries with key > threshold.key plus the first threshold.ties with key equal to
// it, in index order (parts are consecutive ranges), and sets their residual to y - y = 0.
// Unsent non-finite entries exist only when the threshold is non-finite: their residual is
// zeroed by one more pass.
void writeSelected(const Input& in, const std::vector<std::vector<Entry>>& parts, Threshold threshold,
                   uint8_t* indices, uint8_t* values) {
  size_t kept = 0, ties = 0;
  for (const auto& entries : parts) {
    for (const Entry& e : entries) {
      const Key key = magnitudeBits(e.value);
      if (key < threshold.key || (key == threshold.key && ties++ >= threshold.ties)) continue;
      storeLE(indices + 4 * kept, e.index);
      storeLE(values + 4 * kept, e.value);
      if (in.residual != nullptr) in.residual[e.index] = residualOf(e.value, e.value);
      ++kept;
    }
  }
  if (in.residual != nullptr && threshold.key >= kInfinityKey) {
    parallelFor(in.numel, 1, kTile, [&](size_t begin, size_t end) { clearNonFinite(in.residual, begin, end); });
  }
}

// ---- approximate top-k: threshold from a sample ---------------------------------------------

constexpr size_t kSampleSize = size_t(1) << 15;

// A key that about k + 4 standard deviations of the population exceed, from kSampleSize
// counter-based random elements of y = x + residual (not formed yet). 0 when the sample cannot
// tell (k close to numel).
DDLCOMM_MULTIVERSION Key sampleThreshold(const Input& in, size_t k, uint64_t seed, uint64_t stream) {
  const double expected = double(k) * double(kSampleSize) / double(in.numel);
  const size_t rank = size_t(std::ceil(expected + 4.0 * std::sqrt(expected) + 4.0));
  if (rank >= kSampleSize) return 0;
  std::vector<Key> keys(kSampleSize);
  withElement(in.type, [&](auto e) __attribute__((always_inline)) {
    using E = decltype(e);
    const auto* x = static_cast<const typename E::Raw*>(in.x);
    for (size_t j = 0; j < kSampleSize; ++j) {
      const size_t i = uniformBelow(counterBits(seed, stream, j), in.numel);
      float y = E::load(x[i]);
      if (in.residual != nullptr) y += in.residual[i];
      keys[j] = magnitudeBits(y);
    }
  });
  std::nth_element(keys.begin(), keys.begin() + (rank - 1), keys.end(), std::greater<Key>());
  return keys[rank - 1];
}

// Selects among the candidates (all entries with key >= some t, at least k of them).
Threshold thresholdAmong(const std::vector<std::vector<Entry>>& parts, size_t k) {
  std::vector<Key> keys;
  size_t total = 0;
  for (const auto& entries : parts) total += entries.size();
  keys.reserve(total);
  for (const auto& entries : parts) {
    for (const Entry& e : entries) keys.push_back(magnitudeBits(e.value));
  }
  std::nth_element(keys.begin(), keys.begin() + (k - 1), keys.end(), std::greater<Key>());
  const Key t = keys[k - 1];
  const size_t above = size_t(std::count_if(keys.begin(), keys.end(), [t](Key key) { return key > t; }));
  return {t, k - above};
}

}  // namespace

void encodeTopK(const Config& config, const Input& in, uint64_t stream, size_t k, uint8_t* indices,
                uint8_t* values, TopKStats* stats) {
  if (k == 0) return;
  const size_t limit = 4 * k + kSampleSize;  // candidates worth collecting and selecting among
  std::vector<std::vector<Entry>> parts;
  bool first = true;  // y not formed yet
  if (config.approximate && in.numel >= 8 * kSampleSize) {
    const Key t = sampleThreshold(in, k, config.seed, stream);
    if (t > 0) {
      const size_t found = collectParts(in, true, t, SIZE_MAX, limit, parts);
      if (found >= k && found <= limit) {
        if (stats) stats->sampled.fetch_add(1, std::memory_order_relaxed);
        return writeSelected(in, parts, thresholdAmong(parts, k), indices, values);
      }
      first = false;
    }
    if (stats) stats->exactFallbacks.fetch_add(1, std::memory_order_relaxed);
  }
  const RadixResult radix = radixSelect(in, k, first, limit);
  if (radix.exact) {
    collectParts(in, false, radix.threshold.key, radix.threshold.ties, SIZE_MAX, parts);
    return writeSelected(in, parts, radix.threshold, indices, values);
  }
  collectParts(in, false, radix.threshold.key, SIZE_MAX, limit, parts);
  writeSelected(in, parts, thresholdAmong(parts, k), indices, values);
}

}  // namespace ddlcomm::compress
