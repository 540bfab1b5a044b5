// CPU emulator (tests/cuda/emu): device-side language features for kernels compiled as C++.
// Each CUDA thread of a block runs as a coroutine on one host thread; blocks run one after
// another. Warp collectives and __syncthreads are barriers between the coroutines, so
// divergent collectives are reported (as a deadlock or an error) instead of hanging.
// Races and the memory model are NOT emulated: the interleaving is cooperative.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>

#include "cuda_runtime_api.h"

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __grid_constant__
#define __shared__ static

struct uint3 {
  unsigned x, y, z;
};
struct dim3 {
  unsigned x, y, z;
  dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

namespace emu {
extern uint3 g_blockIdx;
extern dim3 g_blockDim, g_gridDim;
const uint3& currentThreadIdx();
// Runs body once per thread of every block; returns after the whole grid finished.
void runGrid(uint64_t grid, unsigned block, const std::function<void()>& body);
// Barrier among the 32 lanes of the calling thread's warp; exchanges one 8-byte value per lane.
void warpExchange(uint64_t mine, uint64_t* all);
void syncThreads();
[[noreturn]] void fatal(const char* what);
// Kernel launches and stream memsets and copies since the program started.
uint64_t operations();
}  // namespace emu

#define threadIdx (::emu::currentThreadIdx())
#define blockIdx (::emu::g_blockIdx)
#define blockDim (::emu::g_blockDim)
#define gridDim (::emu::g_gridDim)

template <typename... KArgs>
void emuLaunch(void (*kernel)(KArgs...), uint64_t grid, unsigned block, cudaStream_t, KArgs... args) {
  emu::runGrid(grid, block, [&] { kernel(args...); });
}

inline void __syncthreads() { emu::syncThreads(); }

namespace emu {
template <typename T>
inline uint64_t toBits(T v) {
  static_assert(sizeof(T) <= 8, "warp exchange of at most 8 bytes");
  uint64_t b = 0;
  std::memcpy(&b, &v, sizeof(T));
  return b;
}
template <typename T>
inline T fromBits(uint64_t b) {
  T v;
  std::memcpy(&v, &b, sizeof(T));
  return v;
}
inline void checkMask(unsigned mask) {
  if (mask != 0xffffffffu) fatal("emulator supports full-warp masks only");
}
}  // namespace emu

inline void __syncwarp(unsigned mask = 0xffffffffu) {
  emu::checkMask(mask);
  uint64_t all[32];
  emu::warpExchange(0, all);
}

template <typename T>
inline T __shfl_sync(unsigned mask, T v, int src, int width = 32) {
  emu::checkMask(mask);
  if (width != 32) emu::fatal("emulator supports width 32 only");
  uint64_t all[32];
  emu::warpExchange(emu::toBits(v), all);
  return emu::fromBits<T>(all[src & 31]);
}
template <typename T>
inline T __shfl_down_sync(unsigned mask, T v, unsigned d, int width = 32) {
  emu::checkMask(mask);
  if (width != 32) emu::fatal("emulator supports width 32 only");
  uint64_t all[32];
  emu::warpExchange(emu::toBits(v), all);
  const unsigned lane = threadIdx.x % 32;
  return lane + d < 32 ? emu::fromBits<T>(all[lane + d]) : v;
}
template <typename T>
inline T __shfl_up_sync(unsigned mask, T v, unsigned d, int width = 32) {
  emu::checkMask(mask);
  if (width != 32) emu::fatal("emulator supports width 32 only");
  uint64_t all[32];
  emu::warpExchange(emu::toBits(v), all);
  const unsigned lane = threadIdx.x % 32;
  return lane >= d ? emu::fromBits<T>(all[lane - d]) : v;
}
template <typename T>
inline T __shfl_xor_sync(unsigned mask, T v, int m, int width = 32) {
  emu::checkMask(mask);
  if (width != 32) emu::fatal("emulator supports width 32 only");
  uint64_t all[32];
  emu::warpExchange(emu::toBits(v), all);
  return emu::fromBits<T>(all[(threadIdx.x % 32) ^ unsigned(m)]);
}
inline unsigned __ballot_sync(unsigned mask, int pred) {
  emu::checkMask(mask);
  uint64_t all[32];
  emu::warpExchange(pred ? 1 : 0, all);
  unsigned bits = 0;
  for (int i = 0; i < 32; ++i) bits |= unsigned(all[i] & 1) << i;
  return bits;
}

// Cooperative scheduling: a read-modify-write cannot be interrupted.
inline unsigned atomicAdd(unsigned* p, unsigned v) {
  const unsigned old = *p;
  *p = old + v;
  return old;
}
inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) {
  const unsigned long long old = *p;
  *p = old + v;
  return old;
}
inline unsigned atomicMin(unsigned* p, unsigned v) {
  const unsigned old = *p;
  if (v < old) *p = v;
  return old;
}
inline unsigned atomicOr(unsigned* p, unsigned v) {
  const unsigned old = *p;
  *p = old | v;
  return old;
}
inline unsigned atomicCAS(unsigned* p, unsigned compare, unsigned v) {
  const unsigned old = *p;
  if (old == compare) *p = v;
  return old;
}
inline uint64_t __umul64hi(uint64_t a, uint64_t b) { return uint64_t((unsigned __int128)a * b >> 64); }
inline int __popc(unsigned v) { return __builtin_popcount(v); }

inline unsigned __float_as_uint(float f) { return emu::toBits(f) & 0xffffffffu; }
inline float __uint_as_float(unsigned u) { return emu::fromBits<float>(u); }
inline float __int_as_float(int i) { return emu::fromBits<float>(uint32_t(i)); }
// x86-64 SSE arithmetic is IEEE round-to-nearest; the emulator is built with -ffp-contract=off.
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fsqrt_rn(float a) { return std::sqrt(a); }
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline double __ddiv_rn(double a, double b) { return a / b; }
inline float __uint2float_rn(unsigned u) { return float(u); }
