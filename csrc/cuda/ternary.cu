// Ternary compression (TernGrad) with error feedback: per block s = max |yc| where yc is y,
// optionally clipped at clip * std(block); element i becomes sign(y) * s with probability
// |yc| / s (u = counterUniform(seed, stream, i) < |yc| / s), else 0. Same warp-per-block
// structure as onebit.cu: the std uses the contract's 32-lane sums.
#include "cuda/common.cuh"
#include "cuda/launchers.h"

namespace ddlcomm::gpu::detail {
namespace {

constexpr int kThreads = 256;
constexpr int kWarpsPerCta = kThreads / kWarpSize;
constexpr uint32_t kCachedRounds = 8;

struct TernaryParams {
  uint64_t numel;
  uint64_t nblocks;
  uint32_t blockSize;
  float clip;  // 0: off
  uint64_t seed;
  uint64_t stream;
  float* scales;
  uint8_t* codes;
  float* clipBounds;  // generic path with clipping: c per block (workspace), else null
  uint8_t* payload;
  HeaderWords header;
};

// Clip at c, keeping the sign. A NaN c (std of a non-finite block) or NaN y leaves y as is,
// so a non-finite block always gets a non-finite scale.
__device__ __forceinline__ float clipAt(float y, float c) { return fabsf(y) > c ? copysignf(c, y) : y; }

// Code of one element: 0 -> 0, 1 -> +s, 2 -> -s. A non-finite scale gets a sign code for every
// element, so the whole block decodes non-finite (the contract's non-finite rule).
__device__ __forceinline__ uint32_t ternaryCode(float y, float yc, float s, const TernaryParams& p, uint64_t i) {
  if (!isFiniteF(s)) return y < 0.f ? 2u : 1u;
  const float prob = __fdiv_rn(fabsf(yc), s);  // s == 0: NaN, never taken
  const float u = compress::counterUniform(p.seed, p.stream, i);
  return u < prob ? (yc > 0.f ? 1u : 2u) : 0u;
}

__device__ __forceinline__ float decodeCode(uint32_t code, float s) {
  return code == 1u ? s : (code == 2u ? -s : 0.f);
}

// Spreads 4 bits to the even bit positions 0, 2, 4, 6.
__device__ __forceinline__ uint32_t spread4(uint32_t b) {
  return (b & 1u) | ((b & 2u) << 1) | ((b & 4u) << 2) | ((b & 8u) << 3);
}

// Fused encode when blockSize % 4 == 0 (blocks start on code-byte boundaries).
template <typename XT, bool kWriteData>
__global__ __launch_bounds__(kThreads) void ternaryEncodeKernel(const typename XT::Raw* __restrict__ x,
                                                                float* __restrict__ residual, TernaryParams p) {
  writeHeader(p.payload, p.header);
  const int lane = threadIdx.x % kWarpSize;
  const uint64_t warpStride = uint64_t(gridDim.x) * kWarpsPerCta;
  for (uint64_t b = uint64_t(blockIdx.x) * kWarpsPerCta + threadIdx.x / kWarpSize; b < p.nblocks; b += warpStride) {
    const uint64_t base = b * p.blockSize;
    const uint32_t count = uint32_t(minOf<uint64_t>(p.blockSize, p.numel - base));
    const uint32_t rounds = (count + kWarpSize - 1) / kWarpSize;
    auto yAt = [&](uint32_t off) { return loadY<XT>(x, residual, base + off); };

    float v[kCachedRounds];
#pragma unroll
    for (uint32_t t = 0; t < kCachedRounds; ++t) {
      const uint32_t off = t * kWarpSize + lane;
      v[t] = off < count ? yAt(off) : 0.f;
    }

    // Clip bound c = clip * std, std = sqrt(sum((y - mean)^2) / count), both sums in lanes.
    float c = __int_as_float(0x7fc00000);  // NaN: no clipping
    if (p.clip > 0.f) {
      float s1 = 0.f;
#pragma unroll
      for (uint32_t t = 0; t < kCachedRounds; ++t)
        if (t * kWarpSize + lane < count) s1 = __fadd_rn(s1, v[t]);
      for (uint32_t t = kCachedRounds; t < rounds; ++t)
        if (t * kWarpSize + lane < count) s1 = __fadd_rn(s1, yAt(t * kWarpSize + lane));
      const float n = __uint2float_rn(count);
      const float mean = __fdiv_rn(warpSumContract(s1), n);
      float s2 = 0.f;
      auto addSq = [&](float y) {
        const float d = __fsub_rn(y, mean);
        s2 = __fadd_rn(s2, __fmul_rn(d, d));
      };
#pragma unroll
      for (uint32_t t = 0; t < kCachedRounds; ++t)
        if (t * kWarpSize + lane < count) addSq(v[t]);
      for (uint32_t t = kCachedRounds; t < rounds; ++t)
        if (t * kWarpSize + lane < count) addSq(yAt(t * kWarpSize + lane));
      c = __fmul_rn(p.clip, __fsqrt_rn(__fdiv_rn(warpSumContract(s2), n)));
    }

    // s = max |yc| as bits: order-free, and a NaN (bits above +inf) wins, so it propagates.
    uint32_t m = 0;
#pragma unroll
    for (uint32_t t = 0; t < kCachedRounds; ++t)
      if (t * kWarpSize + lane < count) m = maxOf(m, __float_as_uint(fabsf(clipAt(v[t], c))));
    for (uint32_t t = kCachedRounds; t < rounds; ++t)
      if (t * kWarpSize + lane < count) m = maxOf(m, __float_as_uint(fabsf(clipAt(yAt(t * kWarpSize + lane), c))));
    const float s = __uint_as_float(warpMaxU32(m));
    if (lane == 0) {
      p.scales[b] = s;
      if (!kWriteData && p.clipBounds) p.clipBounds[b] = c;
    }
    if (!kWriteData) continue;

    // One ballot pair per 32 elements = 8 code bytes, written by lanes 0..7.
    auto emit = [&](uint32_t t, float y) {
      const uint32_t off = t * kWarpSize + lane;
      const bool in = off < count;
      const uint32_t code = in ? ternaryCode(y, clipAt(y, c), s, p, base + off) : 0u;
      if (in && residual) residual[base + off] = residualAfter(y, decodeCode(code, s));
      const uint32_t pos = __ballot_sync(kFullMask, code == 1u);
      const uint32_t neg = __ballot_sync(kFullMask, code == 2u);
      if (lane < 8 && uint32_t(lane) * 4 < count - t * kWarpSize) {
        const uint32_t byte = spread4((pos >> (4 * lane)) & 0xfu) | (spread4((neg >> (4 * lane)) & 0xfu) << 1);
        p.codes[(base + t * kWarpSize) / 4 + lane] = uint8_t(byte);
      }
    };
#pragma unroll
    for (uint32_t t = 0; t < kCachedRounds; ++t)
      if (t < rounds) emit(t, v[t]);
    for (uint32_t t = kCachedRounds; t < rounds; ++t) {
      const uint32_t off = t * kWarpSize + lane;
      emit(t, off < count ? yAt(off) : 0.f);
    }
  }
}

// Generic path (blockSize % 4 != 0, where a code byte can span two blocks): after
// ternaryEncodeKernel<..., false> stored the scales (and the clip bounds, in the workspace),
// one thread per code byte packs 4 elements.
template <typename XT>
__global__ __launch_bounds__(kThreads) void ternaryPackKernel(const typename XT::Raw* __restrict__ x,
                                                              float* __restrict__ residual, TernaryParams p) {
  const uint64_t bytes = (p.numel + 3) / 4;
  for (uint64_t q = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x; q < bytes; q += uint64_t(gridDim.x) * blockDim.x) {
    uint32_t byte = 0;
    for (uint32_t e = 0; e < 4; ++e) {
      const uint64_t i = q * 4 + e;
      if (i >= p.numel) break;
      const uint64_t b = i / p.blockSize;
      const float s = p.scales[b];
      const float c = p.clipBounds ? p.clipBounds[b] : __int_as_float(0x7fc00000);
      const float y = loadY<XT>(x, residual, i);
      const uint32_t code = ternaryCode(y, clipAt(y, c), s, p, i);
      if (residual) residual[i] = residualAfter(y, decodeCode(code, s));
      byte |= code << (2 * e);
    }
    p.codes[q] = uint8_t(byte);
  }
}

template <typename OutT, bool kAcc>
__global__ __launch_bounds__(kThreads) void ternaryDecodeKernel(const float* __restrict__ scales,
                                                                const uint8_t* __restrict__ codes, uint64_t numel,
                                                                uint64_t nblocks, uint32_t blockSize,
                                                                typename OutT::Raw* __restrict__ out) {
  const int lane = threadIdx.x % kWarpSize;
  const uint64_t warpStride = uint64_t(gridDim.x) * kWarpsPerCta;
  for (uint64_t b = uint64_t(blockIdx.x) * kWarpsPerCta + threadIdx.x / kWarpSize; b < nblocks; b += warpStride) {
    const uint64_t base = b * blockSize;
    const uint32_t count = uint32_t(minOf<uint64_t>(blockSize, numel - base));
    const float s = scales[b];
    for (uint32_t off = lane; off < count; off += kWarpSize) {
      const uint64_t i = base + off;
      const float d = decodeCode((codes[i >> 2] >> (2 * (i & 3))) & 3u, s);
      if (kAcc) {
        out[i] = __fadd_rn(out[i], d);
      } else {
        out[i] = OutT::fromFloat(d);
      }
    }
  }
}

template <typename XT>
void encodeTyped(const EncodeArgs& a) {
  TernaryParams p;
  p.numel = a.numel;
  p.nblocks = a.layout.nblocks;
  p.blockSize = a.config.blockSize;
  p.clip = a.config.clip;
  p.seed = a.config.seed;
  p.stream = a.stream;
  p.scales = reinterpret_cast<float*>(a.payload + a.layout.scalesOffset);
  p.codes = a.payload + a.layout.dataOffset;
  p.clipBounds = nullptr;
  p.payload = a.payload;
  p.header = a.header;
  const auto* x = static_cast<const typename XT::Raw*>(a.x);
  const uint64_t grid = gridFor(p.nblocks, kWarpsPerCta);
  if (grid == 0) {
    launch(writeHeaderKernel, 1, 32, a.cudaStream, a.payload, a.header);
  } else if (p.blockSize % 4 == 0) {
    launch(ternaryEncodeKernel<XT, true>, grid, kThreads, a.cudaStream, x, a.residual, p);
  } else {
    if (p.clip > 0.f) p.clipBounds = static_cast<float*>(a.workspace);  // sized by encodeWorkspaceBytes
    launch(ternaryEncodeKernel<XT, false>, grid, kThreads, a.cudaStream, x, a.residual, p);
    launch(ternaryPackKernel<XT>, gridFor((p.numel + 3) / 4, kThreads), kThreads, a.cudaStream, x, a.residual, p);
  }
}

template <typename OutT, bool kAcc>
void decodeTyped(const DecodeArgs& a) {
  launch(ternaryDecodeKernel<OutT, kAcc>, gridFor(a.layout.nblocks, kWarpsPerCta), kThreads, a.cudaStream,
         reinterpret_cast<const float*>(a.payload + a.layout.scalesOffset), a.payload + a.layout.dataOffset, a.numel,
         a.layout.nblocks, a.blockSize, static_cast<typename OutT::Raw*>(a.out));
}

}  // namespace

size_t ternaryWorkspaceBytes(const compress::Config& config, uint64_t numel) {
  if (config.blockSize == 0 || config.blockSize % 4 == 0 || !(config.clip > 0.f)) return 0;
  return 4 * ((numel + config.blockSize - 1) / config.blockSize);
}

void encodeTernary(const EncodeArgs& a) {
  switch (a.xType) {
    case DataType::Float16: return encodeTyped<F16>(a);
    case DataType::BFloat16: return encodeTyped<BF16>(a);
    default: return encodeTyped<F32>(a);
  }
}

void decodeTernary(const DecodeArgs& a) {
  if (a.accumulate) return decodeTyped<F32, true>(a);
  switch (a.outType) {
    case DataType::Float16: return decodeTyped<F16, false>(a);
    case DataType::BFloat16: return decodeTyped<BF16, false>(a);
    default: return decodeTyped<F32, false>(a);
  }
}

}  // namespace ddlcomm::gpu::detail
