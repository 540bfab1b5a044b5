// float16 / bfloat16 <-> float32 conversions, written so that loops using them vectorize
// (bf16 by integer arithmetic, fp16 through _Float16, which becomes vcvtps2ph with F16C).
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

inline float fp16ToFloat(uint16_t bits) {
  _Float16 h;
  std::memcpy(&h, &bits, sizeof h);
  return float(h);
}

inline uint16_t floatToFp16(float f) {
  _Float16 h = _Float16(f);
  uint16_t bits;
  std::memcpy(&bits, &h, sizeof bits);
  return bits;
}

}  // namespace ddlcomm

// Compile the marked function for AVX-512, AVX2 (+F16C, FMA) and baseline x86-64, and pick
// one at load time. Elsewhere the compiler's default target is used.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__CUDACC__) && !defined(__clang__)
#define DDLCOMM_MULTIVERSION __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define DDLCOMM_MULTIVERSION
#endif
