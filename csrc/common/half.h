// float16 / bfloat16 <-> float32 conversions, written with integer arithmetic and selects so
// that loops using them vectorize on any x86-64 level.
#pragma once

#include <cstdint>
#include <cstring>

namespace ddlcomm {

inline float bf16ToFloat(uint16_t bits) {
  uint32_t u = uint32_t(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// Round to nearest even, NaN stays NaN (quiet), like torch's c10::BFloat16.
inline uint16_t floatToBf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

// fp16 by integer arithmetic too (F. Giesen's branchless conversions): GCC 12 converts
// _Float16 with scalar F16C instructions only, which keeps the loops from vectorizing.
inline float fp16ToFloat(uint16_t bits) {
  auto asFloat = [](uint32_t u) {
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
  };
  constexpr uint32_t kExponent = 0x7c00u << 13;  // half exponent bits, in float position
  const uint32_t shifted = uint32_t(bits & 0x7fffu) << 13;
  const uint32_t exponent = shifted & kExponent;
  const uint32_t rebiased = shifted + ((127u - 15u) << 23);
  // Zero and subnormals: renormalize with a float subtraction (exact, no subnormal operands).
  const float subnormal = asFloat(rebiased + (1u << 23)) - asFloat(113u << 23);
  uint32_t subnormalBits;
  std::memcpy(&subnormalBits, &subnormal, sizeof subnormalBits);
  const uint32_t magnitude = exponent == kExponent ? rebiased + ((128u - 16u) << 23)  // inf / NaN
                             : exponent == 0       ? subnormalBits
                                                   : rebiased;
  return asFloat(magnitude | (uint32_t(bits & 0x8000u) << 16));
}

// Round to nearest even; beyond the half range -> inf; NaN -> quiet NaN 0x7e00 (sign kept).
inline uint16_t floatToFp16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  const uint32_t sign = u & 0x80000000u;
  u ^= sign;
  const uint32_t special = u > 0x7f800000u ? 0x7e00u : 0x7c00u;
  // Half subnormals and zero: a float addition of 0.5 rounds at the half's last mantissa bit.
  float shifted;
  std::memcpy(&shifted, &u, sizeof shifted);
  shifted += 0.5f;
  uint32_t subnormal;
  std::memcpy(&subnormal, &shifted, sizeof subnormal);
  subnormal -= 126u << 23;  // the bits of 0.5f
  // Normal halves: rebias the exponent and round to nearest even (a carry may reach infinity).
  const uint32_t normal = (u + ((15u - 127u) << 23) + 0xfffu + ((u >> 13) & 1u)) >> 13;
  const uint32_t magnitude = u >= (143u << 23) ? special : u < (113u << 23) ? subnormal : normal;
  return uint16_t(magnitude | (sign >> 16));
}

}  // namespace ddlcomm

// Compile the marked function for AVX-512, AVX2 (+F16C, FMA) and baseline x86-64, and pick
// one at load time. Elsewhere the compiler's default target is used.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__CUDACC__) && !defined(__clang__)
#define DDLCOMM_MULTIVERSION __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define DDLCOMM_MULTIVERSION
#endif
