// The loops shared by the block formats, 1-bit (onebit.cc) and ternary (ternary.cc): per
// block, float32 scales, then one code of codeBits(kFormat) bits per element, packed least
// significant first (wire_format.h). A format supplies a small policy Code:
//   kFormat, kVariantDecodes       its Format; whether decoding depends on the variant flag V
//   variant(config)                V: 1-bit's two scales, ternary's stochastic rounding
//   Scale                          what a block's codes decode against
//   blockScale<E, EF, V>(config, x, r, len)       the block's Scale (compress.h's contract)
//   storeScale<V>(dst, s), loadScale<V>(src)      its blockScaleBytes(kFormat, V) payload bytes
//   encodeRow<E, EF, V>(config, stream, s, x, r, index, off, n)
//       codes of row elements [off, off + n) (n <= 32), packed; writes their residual.
//       index: the vector index of x[0] (ternary's counter-based randomness)
//   decodeRow(codes, s, row, n)    row[j] = the value code j decodes to
// Everything is inlined into each format's multiversioned parts, declared at the end.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "compress/bits.h"
#include "compress/block_sum.h"
#include "compress/compress.h"
#include "compress/elements.h"

namespace ddlcomm::compress {

// What encoding or decoding a 1-bit or ternary vector needs: the section pointers are at
// block 0 of the vector in `in` (of `numel` elements for decoding).
struct BlockEncodeJob {
  const Config& config;
  const Input& in;
  uint64_t stream;
  uint8_t* scales;
  uint8_t* codes;
};
struct BlockDecodeJob {
  size_t numel;
  uint32_t blockSize;
  bool twoScales;
  const uint8_t* scales;
  const uint8_t* codes;
  const Output& out;
};

template <class Code>
struct BlockCodec {
  static constexpr unsigned kBits = codeBits(Code::kFormat);

  template <class E, bool EF, bool V>
  [[gnu::always_inline]] static void encode(const Config& config, const Input& in, uint64_t stream, uint8_t* scales,
                                            uint8_t* codes, size_t b0, size_t b1) {
    const auto* x = static_cast<const typename E::Raw*>(in.x);
    const size_t bs = config.blockSize, scaleBytes = blockScaleBytes(Code::kFormat, V);
    BitWriter writer(codes + b0 * bs * kBits / 8);
    for (size_t b = b0; b < b1; ++b) {
      const size_t start = b * bs, len = std::min(bs, in.numel - start);
      if (b + kPrefetchBlocks < b1) {
        const size_t ahead = start + kPrefetchBlocks * bs;
        prefetchY<E, EF>(x, in.residual, ahead, std::min(bs, in.numel - ahead));
      }
      const auto* xb = x + start;
      float* rb = EF ? in.residual + start : nullptr;
      const typename Code::Scale s = Code::template blockScale<E, EF, V>(config, xb, rb, len);
      Code::template storeScale<V>(scales + scaleBytes * b, s);
      forEachRow(len, [&](size_t off, auto n) __attribute__((always_inline)) {
        writer.putWide(Code::template encodeRow<E, EF, V>(config, stream, s, xb, rb, in.first + start, off, n),
                       kBits * n);
      });
    }
    writer.flush();
  }

  template <bool V, class Sink>
  [[gnu::always_inline]] static void decode(size_t numel, size_t bs, const uint8_t* scales, const uint8_t* codes,
                                            Sink sink, size_t b0, size_t b1) {
    const size_t scaleBytes = blockScaleBytes(Code::kFormat, V);
    BitReader reader(codes + b0 * bs * kBits / 8);
    for (size_t b = b0; b < b1; ++b) {
      const size_t start = b * bs, len = std::min(bs, numel - start);
      const typename Code::Scale s = Code::template loadScale<V>(scales + scaleBytes * b);
      forEachRow(len, [&](size_t off, auto n) __attribute__((always_inline)) {
        float row[kLanes];
        Code::decodeRow(reader.getWide(kBits * n), s, row, n);
        sink.row(start + off, row, n);
      });
    }
  }

  // Blocks [b0, b1), with the run-time choices as template arguments: input dtype, error
  // feedback, variant.
  [[gnu::always_inline]] static void encodePart(const BlockEncodeJob& j, size_t b0, size_t b1) {
    withElement(j.in.type, [&](auto e) __attribute__((always_inline)) {
      withFlag(j.in.residual != nullptr, [&](auto ef) __attribute__((always_inline)) {
        withFlag(Code::variant(j.config), [&](auto v) __attribute__((always_inline)) {
          encode<decltype(e), decltype(ef)::value, decltype(v)::value>(j.config, j.in, j.stream, j.scales, j.codes,
                                                                      b0, b1);
        });
      });
    });
  }

  [[gnu::always_inline]] static void decodePart(const BlockDecodeJob& j, size_t b0, size_t b1) {
    withSink(j.out, [&](auto sink) __attribute__((always_inline)) {
      if constexpr (Code::kVariantDecodes) {
        withFlag(j.twoScales, [&](auto v) __attribute__((always_inline)) {
          decode<decltype(v)::value>(j.numel, j.blockSize, j.scales, j.codes, sink, b0, b1);
        });
      } else {
        decode<false>(j.numel, j.blockSize, j.scales, j.codes, sink, b0, b1);
      }
    });
  }
};

// Each format's BlockCodec parts, multiversioned (onebit.cc, ternary.cc): payload.cc's table
// names them, and threads them over a vector or runs one on a tile.
void encodeOneBitPart(const BlockEncodeJob& job, size_t b0, size_t b1);
void decodeOneBitPart(const BlockDecodeJob& job, size_t b0, size_t b1);
void encodeTernaryPart(const BlockEncodeJob& job, size_t b0, size_t b1);
void decodeTernaryPart(const BlockDecodeJob& job, size_t b0, size_t b1);

}  // namespace ddlcomm::compress
