// Random-k with error feedback: k distinct indices drawn uniformly with counter-based
// randomness (the same draw on any thread count or device), their values y = x + residual,
// optionally scaled by numel / k; every other element stays in the residual.
#include <algorithm>
#include <vector>

#include "common/half.h"
#include "compress/bits.h"
#include "compress/counter_random.h"
#include "compress/kernels.h"
#include "compress/parallel.h"

namespace ddlcomm::compress {
namespace {

// Floyd's algorithm: k distinct indices, uniform over all k-subsets, as a bitmap.
std::vector<uint64_t> floydSample(size_t numel, size_t k, uint64_t seed, uint64_t stream) {
  std::vector<uint64_t> taken((numel + 63) / 64, 0);
  for (size_t j = numel - k; j < numel; ++j) {
    size_t t = uniformBelow(counterBits(seed, stream, j), j + 1);
    if ((taken[t / 64] >> (t % 64)) & 1) t = j;
    taken[t / 64] |= uint64_t(1) << (t % 64);
  }
  return taken;
}

// One pass over the words [w0, w1) of the bitmap: writes the taken entries from payload
// position `kept` on, and the residual y - sent (sent = 0 for the others) everywhere.
template <class E, bool EF>
[[gnu::always_inline]] inline void randomKWords(const Input& in, const uint64_t* taken, float scale, size_t w0,
                                                size_t w1, size_t kept, uint8_t* indices, uint8_t* values) {
  const auto* x = static_cast<const typename E::Raw*>(in.x);
  float* r = in.residual;
  for (size_t w = w0; w < w1; ++w) {
    const size_t base = 64 * w, len = std::min<size_t>(64, in.numel - base);
    for (uint64_t bits = taken[w]; bits != 0; bits &= bits - 1) {
      const size_t i = base + size_t(__builtin_ctzll(bits));
      storeLE(indices + 4 * kept, uint32_t(i));
      storeLE(values + 4 * kept, loadY<E, EF>(x, r, i) * scale);
      ++kept;
    }
    if constexpr (EF) {
      const uint64_t bits = taken[w];
      for (size_t j = 0; j < len; ++j) {
        const float y = loadY<E, EF>(x, r, base + j);
        r[base + j] = residualOf(y, (bits >> j) & 1 ? y * scale : 0.f);
      }
    }
  }
}

DDLCOMM_MULTIVERSION void randomKPart(const Input& in, const uint64_t* taken, float scale, size_t w0, size_t w1,
                                      size_t kept, uint8_t* indices, uint8_t* values) {
  withElement(in.type, [&](auto e) __attribute__((always_inline)) {
    withFlag(in.residual != nullptr, [&](auto ef) __attribute__((always_inline)) {
      randomKWords<decltype(e), decltype(ef)::value>(in, taken, scale, w0, w1, kept, indices, values);
    });
  });
}

}  // namespace

void encodeRandomK(const Config& config, const Input& in, uint64_t stream, size_t k, uint8_t* indices,
                   uint8_t* values) {
  const float scale = config.scaled && k > 0 ? float(double(in.numel) / double(k)) : 1.f;
  const std::vector<uint64_t> taken = floydSample(in.numel, k, config.seed, stream);
  const size_t words = taken.size();
  const size_t parts = threadsFor(in.numel);
  std::vector<size_t> kept(parts + 1, 0);  // payload position where each part starts
  runParts(parts, words, 1, [&](size_t part, size_t w0, size_t w1) {
    for (size_t w = w0; w < w1; ++w) kept[part + 1] += size_t(__builtin_popcountll(taken[w]));
  });
  for (size_t part = 0; part < parts; ++part) kept[part + 1] += kept[part];
  runParts(parts, words, 1, [&](size_t part, size_t w0, size_t w1) {
    randomKPart(in, taken.data(), scale, w0, w1, kept[part], indices, values);
  });
}

}  // namespace ddlcomm::compress
