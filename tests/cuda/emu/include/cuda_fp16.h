// CPU emulator (tests/cuda/emu): float16 conversions through GCC's _Float16 (round to nearest
// even, like the hardware). NaN payload bits may differ from the GPU; the kernels fix NaNs up.
#pragma once

#include <cstring>

struct __half {
  unsigned short x;
};
inline __half __ushort_as_half(unsigned short v) { return __half{v}; }
inline unsigned short __half_as_ushort(__half h) { return h.x; }
inline float __half2float(__half h) {
  _Float16 f;
  std::memcpy(&f, &h.x, 2);
  return float(f);
}
inline __half __float2half_rn(float v) {
  const _Float16 f = _Float16(v);
  __half h;
  std::memcpy(&h.x, &f, 2);
  return h;
}
