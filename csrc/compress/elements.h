// Element access shared by the compressor kernels: how an input dtype is widened to float32,
// how a decoded float32 lands in an output (assigned in its dtype, or accumulated), and the
// error-feedback residual rule. Everything here is inlined into the multiversioned kernels.
#pragma once

#include <cfloat>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "common/dtype.h"
#include "common/half.h"

namespace ddlcomm::compress {

struct F32 {
  using Raw = float;
  static float load(float v) { return v; }
  static float store(float v) { return v; }
};
struct F16 {
  using Raw = uint16_t;
  static float load(uint16_t v) { return fp16ToFloat(v); }
  static uint16_t store(float v) { return floatToFp16(v); }
};
struct BF16 {
  using Raw = uint16_t;
  static float load(uint16_t v) { return bf16ToFloat(v); }
  static uint16_t store(float v) { return floatToBf16(v); }
};

// y = x (+ residual): the value every compressor encodes.
template <class E, bool EF>
[[gnu::always_inline]] inline float loadY(const typename E::Raw* x, const float* residual, size_t i) {
  float y = E::load(x[i]);
  if constexpr (EF) y += residual[i];
  return y;
}

// Block encoders ask for the inputs of the block this many blocks ahead while they encode
// one: on vectors in DRAM the hardware prefetcher alone leaves the 1-bit encode with error
// feedback slower (docs/results/README.md, "CPU kernel choices").
constexpr size_t kPrefetchBlocks = 2;

// Prefetches elements [begin, begin + len) of x (and of the residual, to be written).
template <class E, bool EF>
[[gnu::always_inline]] inline void prefetchY(const typename E::Raw* x, const float* residual, size_t begin,
                                             size_t len) {
  const char* px = reinterpret_cast<const char*>(x + begin);
  for (size_t b = 0; b < len * sizeof(typename E::Raw); b += 64) __builtin_prefetch(px + b);
  if constexpr (EF) {
    const char* pr = reinterpret_cast<const char*>(residual + begin);
    for (size_t b = 0; b < len * sizeof(float); b += 64) __builtin_prefetch(pr + b, 1);
  }
}

[[gnu::always_inline]] inline uint32_t floatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

[[gnu::always_inline]] inline float bitsFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// |y| as an integer that orders like the magnitude, NaN above +inf (any NaN payload): an
// order-free max for ternary scales and the ranking key of top-k.
[[gnu::always_inline]] inline uint32_t magnitudeBits(float y) { return floatBits(y) & 0x7fffffffu; }

// Error feedback: residual = y - decoded, or 0 where that is not finite (see compress.h).
[[gnu::always_inline]] inline float residualOf(float y, float decoded) {
  const float r = y - decoded;
  return std::fabs(r) <= FLT_MAX ? r : 0.f;
}

// The input of an encode, as handed over by the dispatcher.
struct Input {
  DataType type;
  const void* x;
  float* residual;  // null: no error feedback
  size_t numel;
  size_t first = 0;  // index of x[0] in the encoded vector (ternary draws per index)
};

// Where decoded values go: assigned in `type`, or added to float32 (accumulate).
struct Output {
  DataType type;
  void* data;
  bool accumulate;
  // A float32 output too big to stay in cache: rows are written with non-temporal stores,
  // which skip reading the lines first (docs/results/README.md, "CPU kernel choices").
  bool streaming = false;
};

// Sinks take one value, sink(i, v), or a row of n <= 32 values, sink.row(i, v, n).
template <class E>
struct Assign {
  typename E::Raw* out;
  [[gnu::always_inline]] void operator()(size_t i, float v) const { out[i] = E::store(v); }
  template <class N>
  [[gnu::always_inline]] void row(size_t i, const float* v, N n) const {
    for (size_t j = 0; j < n; ++j) out[i + j] = E::store(v[j]);
  }
};
struct Accumulate {
  float* out;
  [[gnu::always_inline]] void operator()(size_t i, float v) const { out[i] += v; }
  template <class N>
  [[gnu::always_inline]] void row(size_t i, const float* v, N n) const {
    for (size_t j = 0; j < n; ++j) out[i + j] += v[j];
  }
};
struct StreamF32 {
  float* out;
  [[gnu::always_inline]] void operator()(size_t i, float v) const { out[i] = v; }
  template <class N>
  [[gnu::always_inline]] void row(size_t i, const float* v, N n) const {
#if defined(__SSE2__)
    if (n % 4 == 0 && reinterpret_cast<uintptr_t>(out + i) % 16 == 0) {
      for (size_t j = 0; j < n; j += 4) _mm_stream_ps(out + i + j, _mm_loadu_ps(v + j));
      return;
    }
#endif
    for (size_t j = 0; j < n; ++j) out[i + j] = v[j];
  }
  // Non-temporal stores are weakly ordered: fence them before anyone else reads the output.
  static void fence() {
#if defined(__SSE2__)
    _mm_sfence();
#endif
  }
};

// Calls fn(std::true_type{}) or fn(std::false_type{}): turns a runtime flag into a template one.
template <class Fn>
[[gnu::always_inline]] inline void withFlag(bool flag, Fn&& fn) {
  if (flag) {
    fn(std::true_type{});
  } else {
    fn(std::false_type{});
  }
}

// Calls fn(E{}) for the input dtype (float32, float16, bfloat16; checked by the dispatcher).
template <class Fn>
[[gnu::always_inline]] inline void withElement(DataType type, Fn&& fn) {
  switch (type) {
    case DataType::Float16: fn(F16{}); return;
    case DataType::BFloat16: fn(BF16{}); return;
    default: fn(F32{}); return;
  }
}

// Calls fn(sink) with the Assign/Accumulate sink that writes `out` at offset 0.
template <class Fn>
[[gnu::always_inline]] inline void withSink(const Output& out, Fn&& fn) {
  if (out.accumulate) return fn(Accumulate{static_cast<float*>(out.data)});
  switch (out.type) {
    case DataType::Float16: fn(Assign<F16>{static_cast<uint16_t*>(out.data)}); return;
    case DataType::BFloat16: fn(Assign<BF16>{static_cast<uint16_t*>(out.data)}); return;
    default:
      if (out.streaming) {
        fn(StreamF32{static_cast<float*>(out.data)});
        StreamF32::fence();
      } else {
        fn(Assign<F32>{static_cast<float*>(out.data)});
      }
      return;
  }
}

}  // namespace ddlcomm::compress
