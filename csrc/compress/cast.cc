// Float16 / bfloat16 casts with error feedback: the baseline every user knows. Rounding is to
// nearest even; values beyond the target's range become +-inf (so their residual is reset).
#include "compress/bits.h"
#include "compress/kernels.h"
#include "compress/parallel.h"

namespace ddlcomm::compress {
namespace {

constexpr size_t kAlign = 64;

template <class E, bool EF, class To>
[[gnu::always_inline]] inline void encodeRange(const Input& in, uint8_t* values, size_t begin, size_t end) {
  const auto* x = static_cast<const typename E::Raw*>(in.x);
  float* r = in.residual;  // a local: stores through in.residual could alias `in` itself
  for (size_t i = begin; i < end; ++i) {
    const float y = loadY<E, EF>(x, r, i);
    const uint16_t bits = To::store(y);
    if constexpr (EF) r[i] = residualOf(y, To::load(bits));
    storeLE(values + 2 * i, bits);
  }
}

DDLCOMM_MULTIVERSION void encodePart(Format format, const Input& in, uint8_t* values, size_t begin, size_t end) {
  withElement(in.type, [&](auto e) __attribute__((always_inline)) {
    withFlag(in.residual != nullptr, [&](auto ef) __attribute__((always_inline)) {
      using E = decltype(e);
      constexpr bool EF = decltype(ef)::value;
      if (format == Format::Float16) {
        encodeRange<E, EF, F16>(in, values, begin, end);
      } else {
        encodeRange<E, EF, BF16>(in, values, begin, end);
      }
    });
  });
}

DDLCOMM_MULTIVERSION void decodePart(Format format, const uint8_t* values, const Output& out, size_t begin,
                                     size_t end) {
  withSink(out, [&](auto sink) __attribute__((always_inline)) {
    if (format == Format::Float16) {
      for (size_t i = begin; i < end; ++i) sink(i, F16::load(loadLE<uint16_t>(values + 2 * i)));
    } else {
      for (size_t i = begin; i < end; ++i) sink(i, BF16::load(loadLE<uint16_t>(values + 2 * i)));
    }
  });
}

}  // namespace

void encodeCast(Format format, const Input& in, uint8_t* values) {
  parallelFor(in.numel, 1, kAlign, [&](size_t begin, size_t end) { encodePart(format, in, values, begin, end); });
}

void decodeCast(Format format, size_t numel, const uint8_t* values, const Output& out) {
  parallelFor(numel, 1, kAlign, [&](size_t begin, size_t end) { decodePart(format, values, out, begin, end); });
}

void encodeCastRange(Format format, const Input& in, uint8_t* values) {
  encodePart(format, in, values + 2 * in.first, 0, in.numel);
}

void decodeCastRange(Format format, size_t first, size_t numel, const uint8_t* values, const Output& out) {
  decodePart(format, values + 2 * first, out, 0, numel);
}

}  // namespace ddlcomm::compress
