// Ternary compression with error feedback: each element becomes -s, 0 or +s (s per block).
// Default, deterministic (ternary weight networks' rule): elements with |y| above 0.7 * mean |y|
// are sent and s is their mean |y|, the scale that minimises the block's squared error for
// that choice, so the error is always smaller than y (what error feedback needs to stay
// bounded). Stochastic (TernGrad): s = max |y| (optionally clipped at clip * std), elements
// chosen by counter-based stochastic rounding so that E[decoded] = y wherever |y| <= s.
#include <algorithm>
#include <cfloat>
#include <cmath>

#include "common/error.h"
#include "common/half.h"
#include "compress/block_codec.h"
#include "compress/kernels.h"

namespace ddlcomm::compress {
namespace {

// The stochastic rule's scale: max |y|, clipped at clip * std when clip > 0.
template <class E, bool EF>
[[gnu::always_inline]] inline float maxScale(const typename E::Raw* x, const float* r, size_t len, float clip) {
  uint32_t maxBits[kLanes] = {};
  LaneSums sum, squares;
  forEachRow(len, [&](size_t off, auto n) __attribute__((always_inline)) {
    for (size_t j = 0; j < n; ++j) maxBits[j] = std::max(maxBits[j], magnitudeBits(loadY<E, EF>(x, r, off + j)));
  });
  if (clip > 0.f) {
    forEachRow(len, [&](size_t off, auto n) __attribute__((always_inline)) {
      for (size_t j = 0; j < n; ++j) {
        const float y = loadY<E, EF>(x, r, off + j);
        sum.lane[j] += y;
        squares.lane[j] += y * y;
      }
    });
  }
  uint32_t maxAll = 0;
  for (size_t j = 0; j < kLanes; ++j) maxAll = std::max(maxAll, maxBits[j]);
  float s = bitsFloat(maxAll);
  if (clip > 0.f) {
    const float mean = sum.total() / float(len);
    const float var = squares.total() / float(len) - mean * mean;
    const float clipAt = clip * std::sqrt(var < 0.f ? 0.f : var);
    if (clipAt < s) s = clipAt;
  }
  return s;
}

// A block's scale and, for the deterministic rule, its threshold (compress.h states the contract).
struct Threshold {
  float at;      // deterministic rule: sent iff |y| > at
  float s;
  bool sendAll;  // a non-finite block: every element decodes to +-s
};

template <class E, bool EF>
[[gnu::always_inline]] inline Threshold blockThreshold(const typename E::Raw* x, const float* r, size_t len) {
  LaneSums abs;
  forEachRow(len, [&](size_t off, auto n) __attribute__((always_inline)) {
    for (size_t j = 0; j < n; ++j) abs.lane[j] += std::fabs(loadY<E, EF>(x, r, off + j));
  });
  const float mean = abs.total() / float(len);
  if (!(mean <= FLT_MAX)) return {0.f, mean, true};
  const float at = mean * kTernaryThreshold;
  LaneSums kept;
  uint32_t count[kLanes] = {};
  forEachRow(len, [&](size_t off, auto n) __attribute__((always_inline)) {
    for (size_t j = 0; j < n; ++j) {
      const float a = std::fabs(loadY<E, EF>(x, r, off + j));
      const bool send = a > at;
      kept.lane[j] += send ? a : 0.f;
      count[j] += send;
    }
  });
  uint32_t sent = 0;
  for (size_t j = 0; j < kLanes; ++j) sent += count[j];
  return {at, sent ? kept.total() / float(sent) : 0.f, false};
}

// The ternary policy of BlockCodec, one rule or the other chosen per call: Stochastic
// (TernGrad) or the deterministic threshold. Code 1 (bits 01) is +s, code 2 (bits 10) is -s.
struct TernaryCode {
  static constexpr Format kFormat = Format::Ternary;
  static constexpr bool kVariantDecodes = false;
  static bool variant(const Config& config) { return config.stochastic; }

  using Scale = Threshold;

  template <class E, bool EF, bool Stochastic>
  [[gnu::always_inline]] static Scale blockScale(const Config& config, const typename E::Raw* x, const float* r,
                                                 size_t len) {
    if constexpr (Stochastic) {
      const float s = maxScale<E, EF>(x, r, len, config.clip);
      return {0.f, s, !(s <= FLT_MAX)};  // non-finite scale: every element decodes to it
    } else {
      return blockThreshold<E, EF>(x, r, len);
    }
  }

  template <bool>
  [[gnu::always_inline]] static void storeScale(uint8_t* dst, const Scale& t) {
    storeLE(dst, t.s);
  }

  template <bool>
  [[gnu::always_inline]] static Scale loadScale(const uint8_t* src) {
    return {0.f, loadLE<float>(src), false};
  }

  template <class E, bool EF, bool Stochastic, class N>
  [[gnu::always_inline]] static uint64_t encodeRow(const Config& config, uint64_t stream, const Scale& t,
                                                   const typename E::Raw* x, float* r, size_t index, size_t off,
                                                   N n) {
    uint32_t sent = 0, positive = 0;
    for (size_t j = 0; j < n; ++j) {
      const float y = loadY<E, EF>(x, r, off + j);
      bool send;
      if constexpr (Stochastic) {
        send = counterUniform(config.seed, stream, index + off + j) * t.s < std::fabs(y);
      } else {
        send = std::fabs(y) > t.at;
      }
      send |= t.sendAll;
      const bool isPos = y >= 0.f;
      if constexpr (EF) r[off + j] = residualOf(y, send ? (isPos ? t.s : -t.s) : 0.f);
      sent |= uint32_t(send) << j;
      positive |= uint32_t(isPos) << j;
    }
    return spreadBits(sent & positive) | spreadBits(sent & ~positive) << 1;
  }

  template <class N>
  [[gnu::always_inline]] static void decodeRow(uint64_t codes, const Scale& t, float* row, N n) {
    const uint32_t plus = gatherEvenBits(codes), minus = gatherEvenBits(codes >> 1);
    for (size_t j = 0; j < n; ++j) row[j] = (plus >> j) & 1 ? t.s : (minus >> j) & 1 ? -t.s : 0.f;
  }
};

// Nonzero when some 2-bit code in the bytes is 3.
DDLCOMM_MULTIVERSION uint8_t invalidCodeBits(const uint8_t* codes, size_t bytes) {
  uint8_t bad = 0;
  for (size_t i = 0; i < bytes; ++i) bad |= codes[i] & (codes[i] >> 1);
  return bad & 0x55;
}

}  // namespace

DDLCOMM_MULTIVERSION void encodeTernaryPart(const BlockEncodeJob& job, size_t b0, size_t b1) {
  BlockCodec<TernaryCode>::encodePart(job, b0, b1);
}

DDLCOMM_MULTIVERSION void decodeTernaryPart(const BlockDecodeJob& job, size_t b0, size_t b1) {
  BlockCodec<TernaryCode>::decodePart(job, b0, b1);
}

void checkTernaryCodes(const uint8_t* codes, size_t numel) {
  const size_t bytes = (numel + 3) / 4;
  if (invalidCodeBits(codes, bytes) == 0) return;
  for (size_t i = 0; i < numel; ++i) {
    DDLCOMM_CHECK(((codes[i / 4] >> (2 * (i % 4))) & 3) != 3, ErrorKind::Protocol, "ternary payload: element ", i,
                  " has the invalid code 3");
  }
}

}  // namespace ddlcomm::compress
