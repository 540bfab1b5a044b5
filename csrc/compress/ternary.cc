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
#include "compress/bits.h"
#include "compress/block_sum.h"
#include "compress/kernels.h"
#include "compress/parallel.h"

namespace ddlcomm::compress {
namespace {

template <class E, bool EF>
[[gnu::always_inline]] inline float blockScale(const typename E::Raw* x, const float* r, size_t len, float clip) {
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

// One rule or the other, chosen per call: Stochastic (TernGrad) or the deterministic threshold.
template <class E, bool EF, bool Stochastic>
[[gnu::always_inline]] inline void encodeBlocks(const Config& config, const Input& in, uint64_t stream,
                                                uint8_t* scales, uint8_t* codes, size_t b0, size_t b1) {
  const auto* x = static_cast<const typename E::Raw*>(in.x);
  const size_t bs = config.blockSize;
  BitWriter writer(codes + b0 * bs / 4);
  for (size_t b = b0; b < b1; ++b) {
    const size_t start = b * bs, len = std::min(bs, in.numel - start);
    if (b + kPrefetchBlocks < b1) {
      const size_t ahead = start + kPrefetchBlocks * bs;
      prefetchY<E, EF>(x, in.residual, ahead, std::min(bs, in.numel - ahead));
    }
    const auto* xb = x + start;
    float* rb = EF ? in.residual + start : nullptr;
    Threshold t;
    if constexpr (Stochastic) {
      const float s = blockScale<E, EF>(xb, rb, len, config.clip);
      t = {0.f, s, !(s <= FLT_MAX)};  // non-finite scale: every element decodes to it
    } else {
      t = blockThreshold<E, EF>(xb, rb, len);
    }
    storeLE(scales + 4 * b, t.s);
    forEachRow(len, [&](size_t off, auto n) __attribute__((always_inline)) {
      uint32_t sent = 0, positive = 0;
      for (size_t j = 0; j < n; ++j) {
        const float y = loadY<E, EF>(xb, rb, off + j);
        bool send;
        if constexpr (Stochastic) {
          send = counterUniform(config.seed, stream, in.first + start + off + j) * t.s < std::fabs(y);
        } else {
          send = std::fabs(y) > t.at;
        }
        send |= t.sendAll;
        const bool isPos = y >= 0.f;
        if constexpr (EF) rb[off + j] = residualOf(y, send ? (isPos ? t.s : -t.s) : 0.f);
        sent |= uint32_t(send) << j;
        positive |= uint32_t(isPos) << j;
      }
      // code 1 (+s) = bits 01, code 2 (-s) = bits 10
      writer.putWide(spreadBits(sent & positive) | spreadBits(sent & ~positive) << 1, 2 * n);
    });
  }
  writer.flush();
}

DDLCOMM_MULTIVERSION void encodePart(const Config& config, const Input& in, uint64_t stream, uint8_t* scales,
                                     uint8_t* codes, size_t b0, size_t b1) {
  withElement(in.type, [&](auto e) __attribute__((always_inline)) {
    withFlag(in.residual != nullptr, [&](auto ef) __attribute__((always_inline)) {
      withFlag(config.stochastic, [&](auto stochastic) __attribute__((always_inline)) {
        encodeBlocks<decltype(e), decltype(ef)::value, decltype(stochastic)::value>(config, in, stream, scales, codes,
                                                                                   b0, b1);
      });
    });
  });
}

template <class Sink>
[[gnu::always_inline]] inline void decodeBlocks(size_t numel, size_t bs, const uint8_t* scales, const uint8_t* codes,
                                                Sink sink, size_t b0, size_t b1) {
  BitReader reader(codes + b0 * bs / 4);
  for (size_t b = b0; b < b1; ++b) {
    const size_t start = b * bs, len = std::min(bs, numel - start);
    const float s = loadLE<float>(scales + 4 * b);
    forEachRow(len, [&](size_t off, auto n) __attribute__((always_inline)) {
      const uint64_t codes = reader.getWide(2 * n);
      const uint32_t plus = gatherEvenBits(codes), minus = gatherEvenBits(codes >> 1);
      float row[kLanes];
      for (size_t j = 0; j < n; ++j) row[j] = (plus >> j) & 1 ? s : (minus >> j) & 1 ? -s : 0.f;
      sink.row(start + off, row, n);
    });
  }
}

DDLCOMM_MULTIVERSION void decodePart(size_t numel, uint32_t blockSize, const uint8_t* scales, const uint8_t* codes,
                                     const Output& out, size_t b0, size_t b1) {
  withSink(out, [&](auto sink) __attribute__((always_inline)) {
    decodeBlocks(numel, blockSize, scales, codes, sink, b0, b1);
  });
}

// Nonzero when some 2-bit code in the bytes is 3.
DDLCOMM_MULTIVERSION uint8_t invalidCodeBits(const uint8_t* codes, size_t bytes) {
  uint8_t bad = 0;
  for (size_t i = 0; i < bytes; ++i) bad |= codes[i] & (codes[i] >> 1);
  return bad & 0x55;
}

}  // namespace

void encodeTernary(const Config& config, const Input& in, uint64_t stream, uint8_t* scales, uint8_t* codes) {
  const size_t blocks = (in.numel + config.blockSize - 1) / config.blockSize;
  parallelFor(blocks, config.blockSize, kBlocksPerUnit,
              [&](size_t b0, size_t b1) { encodePart(config, in, stream, scales, codes, b0, b1); });
}

void decodeTernary(size_t numel, uint32_t blockSize, const uint8_t* scales, const uint8_t* codes, const Output& out) {
  const size_t blocks = (numel + blockSize - 1) / blockSize;
  parallelFor(blocks, blockSize, kBlocksPerUnit,
              [&](size_t b0, size_t b1) { decodePart(numel, blockSize, scales, codes, out, b0, b1); });
}

void encodeTernaryRange(const Config& config, const Input& in, uint64_t stream, uint8_t* scales, uint8_t* codes) {
  const size_t bs = config.blockSize;
  encodePart(config, in, stream, scales + in.first / bs * 4, codes + in.first / 4, 0, (in.numel + bs - 1) / bs);
}

void decodeTernaryRange(size_t first, size_t numel, uint32_t blockSize, const uint8_t* scales, const uint8_t* codes,
                        const Output& out) {
  decodePart(numel, blockSize, scales + first / blockSize * 4, codes + first / 4, out, 0,
             (numel + blockSize - 1) / blockSize);
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
