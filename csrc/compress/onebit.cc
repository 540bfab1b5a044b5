// 1-bit compression with error feedback: one sign bit per element and a scale per block
// (mean |y|, or 1-bit SGD's separate means of the y >= 0 and y < 0 entries).
#include <algorithm>
#include <cmath>

#include "common/half.h"
#include "compress/bits.h"
#include "compress/block_sum.h"
#include "compress/kernels.h"
#include "compress/parallel.h"

namespace ddlcomm::compress {
namespace {

// A block decodes to +pos where the sign bit is set (y >= 0), to -neg elsewhere.
struct Scales {
  float pos, neg;
};

template <class E, bool EF, bool Two>
[[gnu::always_inline]] inline Scales blockScales(const typename E::Raw* x, const float* r, size_t len) {
  if constexpr (Two) {
    LaneSums pos, neg;
    uint32_t count[kLanes] = {};
    forEachRow(len, [&](size_t off, auto n) __attribute__((always_inline)) {
      for (size_t j = 0; j < n; ++j) {
        const float y = loadY<E, EF>(x, r, off + j);
        const bool isPos = y >= 0.f;
        // Selected with integer masks: GCC turns the float selects of a full row into branches.
        const uint32_t keep = 0u - uint32_t(isPos), bits = floatBits(y);
        pos.lane[j] += bitsFloat(bits & keep);
        neg.lane[j] += bitsFloat((bits ^ 0x80000000u) & ~keep);
        count[j] += isPos;
      }
    });
    size_t nPos = 0;
    for (size_t j = 0; j < kLanes; ++j) nPos += count[j];
    const size_t nNeg = len - nPos;
    return {nPos ? pos.total() / float(nPos) : 0.f, nNeg ? neg.total() / float(nNeg) : 0.f};
  } else {
    LaneSums abs;
    forEachRow(len, [&](size_t off, auto n) __attribute__((always_inline)) {
      for (size_t j = 0; j < n; ++j) abs.lane[j] += std::fabs(loadY<E, EF>(x, r, off + j));
    });
    const float scale = abs.total() / float(len);
    return {scale, scale};
  }
}

template <class E, bool EF, bool Two>
[[gnu::always_inline]] inline void encodeBlocks(const Config& config, const Input& in, uint8_t* scales,
                                                uint8_t* bits, size_t b0, size_t b1) {
  const auto* x = static_cast<const typename E::Raw*>(in.x);
  const size_t bs = config.blockSize;
  BitWriter writer(bits + b0 * bs / 8);
  for (size_t b = b0; b < b1; ++b) {
    const size_t start = b * bs, len = std::min(bs, in.numel - start);
    if (b + kPrefetchBlocks < b1) {
      const size_t ahead = start + kPrefetchBlocks * bs;
      prefetchY<E, EF>(x, in.residual, ahead, std::min(bs, in.numel - ahead));
    }
    const auto* xb = x + start;
    float* rb = EF ? in.residual + start : nullptr;
    const Scales s = blockScales<E, EF, Two>(xb, rb, len);
    if constexpr (Two) {
      storeLE(scales + 8 * b, s.pos);
      storeLE(scales + 8 * b + 4, s.neg);
    } else {
      storeLE(scales + 4 * b, s.pos);
    }
    forEachRow(len, [&](size_t off, auto n) __attribute__((always_inline)) {
      writer.put(rowMask(n, [&](size_t j) __attribute__((always_inline)) {
                   const float y = loadY<E, EF>(xb, rb, off + j);
                   const bool isPos = y >= 0.f;
                   if constexpr (EF) rb[off + j] = residualOf(y, isPos ? s.pos : -s.neg);
                   return isPos;
                 }),
                 n);
    });
  }
  writer.flush();
}

DDLCOMM_MULTIVERSION void encodePart(const Config& config, const Input& in, uint8_t* scales, uint8_t* bits,
                                     size_t b0, size_t b1) {
  withElement(in.type, [&](auto e) __attribute__((always_inline)) {
    withFlag(in.residual != nullptr, [&](auto ef) __attribute__((always_inline)) {
      withFlag(config.twoScales, [&](auto two) __attribute__((always_inline)) {
        encodeBlocks<decltype(e), decltype(ef)::value, decltype(two)::value>(config, in, scales, bits, b0, b1);
      });
    });
  });
}

template <bool Two, class Sink>
[[gnu::always_inline]] inline void decodeBlocks(size_t numel, size_t bs, const uint8_t* scales, const uint8_t* bits,
                                                Sink sink, size_t b0, size_t b1) {
  BitReader reader(bits + b0 * bs / 8);
  for (size_t b = b0; b < b1; ++b) {
    const size_t start = b * bs, len = std::min(bs, numel - start);
    const float pos = loadLE<float>(scales + (Two ? 8 : 4) * b);
    const float neg = Two ? loadLE<float>(scales + 8 * b + 4) : pos;
    forEachRow(len, [&](size_t off, auto n) __attribute__((always_inline)) {
      const uint32_t mask = reader.get(n);
      float row[kLanes];
      for (size_t j = 0; j < n; ++j) row[j] = (mask >> j) & 1 ? pos : -neg;
      sink.row(start + off, row, n);
    });
  }
}

DDLCOMM_MULTIVERSION void decodePart(size_t numel, uint32_t blockSize, bool twoScales, const uint8_t* scales,
                                     const uint8_t* bits, const Output& out, size_t b0, size_t b1) {
  withSink(out, [&](auto sink) __attribute__((always_inline)) {
    withFlag(twoScales, [&](auto two) __attribute__((always_inline)) {
      decodeBlocks<decltype(two)::value>(numel, blockSize, scales, bits, sink, b0, b1);
    });
  });
}

}  // namespace

void encodeOneBit(const Config& config, const Input& in, uint8_t* scales, uint8_t* bits) {
  const size_t blocks = (in.numel + config.blockSize - 1) / config.blockSize;
  parallelFor(blocks, config.blockSize, kBlocksPerUnit,
              [&](size_t b0, size_t b1) { encodePart(config, in, scales, bits, b0, b1); });
}

void decodeOneBit(size_t numel, uint32_t blockSize, bool twoScales, const uint8_t* scales, const uint8_t* bits,
                  const Output& out) {
  const size_t blocks = (numel + blockSize - 1) / blockSize;
  parallelFor(blocks, blockSize, kBlocksPerUnit,
              [&](size_t b0, size_t b1) { decodePart(numel, blockSize, twoScales, scales, bits, out, b0, b1); });
}

void encodeOneBitRange(const Config& config, const Input& in, uint8_t* scales, uint8_t* bits) {
  const size_t bs = config.blockSize, scaleBytes = config.twoScales ? 8 : 4;
  encodePart(config, in, scales + in.first / bs * scaleBytes, bits + in.first / 8, 0, (in.numel + bs - 1) / bs);
}

void decodeOneBitRange(size_t first, size_t numel, uint32_t blockSize, bool twoScales, const uint8_t* scales,
                       const uint8_t* bits, const Output& out) {
  decodePart(numel, blockSize, twoScales, scales + first / blockSize * (twoScales ? 8 : 4), bits + first / 8, out, 0,
             (numel + blockSize - 1) / blockSize);
}

}  // namespace ddlcomm::compress
