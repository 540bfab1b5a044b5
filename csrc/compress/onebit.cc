// 1-bit compression with error feedback: one sign bit per element and a scale per block
// (mean |y|, or 1-bit SGD's separate means of the y >= 0 and y < 0 entries).
#include <cmath>

#include "common/half.h"
#include "compress/block_codec.h"

namespace ddlcomm::compress {
namespace {

// The 1-bit policy of BlockCodec: code 1 (y >= 0) decodes to +pos, code 0 to -neg.
struct OneBitCode {
  static constexpr Format kFormat = Format::OneBit;
  static constexpr bool kVariantDecodes = true;  // two scales per block
  static bool variant(const Config& config) { return config.twoScales; }

  struct Scale {
    float pos, neg;
  };

  template <class E, bool EF, bool Two>
  [[gnu::always_inline]] static Scale blockScale(const Config&, const typename E::Raw* x, const float* r, size_t len) {
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

  template <bool Two>
  [[gnu::always_inline]] static void storeScale(uint8_t* dst, Scale s) {
    storeLE(dst, s.pos);
    if constexpr (Two) storeLE(dst + 4, s.neg);
  }

  template <bool Two>
  [[gnu::always_inline]] static Scale loadScale(const uint8_t* src) {
    const float pos = loadLE<float>(src);
    return {pos, Two ? loadLE<float>(src + 4) : pos};
  }

  template <class E, bool EF, bool Two, class N>
  [[gnu::always_inline]] static uint64_t encodeRow(const Config&, uint64_t, Scale s, const typename E::Raw* x,
                                                   float* r, size_t, size_t off, N n) {
    return rowMask(n, [&](size_t j) __attribute__((always_inline)) {
      const float y = loadY<E, EF>(x, r, off + j);
      const bool isPos = y >= 0.f;
      if constexpr (EF) r[off + j] = residualOf(y, isPos ? s.pos : -s.neg);
      return isPos;
    });
  }

  template <class N>
  [[gnu::always_inline]] static void decodeRow(uint64_t codes, Scale s, float* row, N n) {
    const auto mask = uint32_t(codes);
    for (size_t j = 0; j < n; ++j) row[j] = (mask >> j) & 1 ? s.pos : -s.neg;
  }
};

}  // namespace

DDLCOMM_MULTIVERSION void encodeOneBitPart(const BlockEncodeJob& job, size_t b0, size_t b1) {
  BlockCodec<OneBitCode>::encodePart(job, b0, b1);
}

DDLCOMM_MULTIVERSION void decodeOneBitPart(const BlockDecodeJob& job, size_t b0, size_t b1) {
  BlockCodec<OneBitCode>::decodePart(job, b0, b1);
}

}  // namespace ddlcomm::compress
