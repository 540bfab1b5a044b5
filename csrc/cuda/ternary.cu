// Ternary compression with error feedback, as compress.h defines it. Deterministic (default):
// mean = sum |y| / n, at = mean * kTernaryThreshold, element i is sent iff |y| > at, s = mean
// |y| of the sent elements (s = mean and every element sent when mean is not finite).
// Stochastic (TernGrad): s = max |y| (NaN above +inf); with clip > 0, mean = sum(y) / n,
// var = sum(y*y) / n - mean^2, s = clip * sqrt(max(var, 0)) when that is smaller; element i is
// sent iff counterUniform(seed, stream, i) * s < |y| (or s is not finite). A sent element is
// sign(y) * s. Same warp-per-block structure as onebit.cu: the sums are the contract's 32-lane
// sums.
#include <cfloat>

#include "cuda/common.cuh"
#include "cuda/launchers.h"

namespace ddlcomm::gpu::detail {
namespace {

constexpr int kThreads = 256;
constexpr int kWarpsPerCta = kThreads / kWarpSize;
constexpr uint32_t kCachedRounds = 8;
constexpr uint32_t kDecodeBatch = 8;

struct TernaryParams {
  uint64_t numel;
  uint64_t nblocks;
  uint32_t blockSize;
  bool stochastic;
  float thresholdFactor;  // compress::kTernaryThreshold
  float clip;  // 0: off
  uint64_t seed;
  uint64_t stream;
  float* scales;
  uint8_t* codes;
  float* thresholds;  // deterministic generic path: each block's threshold (workspace), else null
  uint8_t* payload;
  HeaderWords header;
};

// Code of one element (0 -> 0, 1 -> +s, 2 -> -s); `at` is the deterministic rule's threshold.
// A non-finite s sends every element, so the whole block decodes non-finite (the contract's
// non-finite rule; the deterministic rule's s is non-finite exactly when its mean is).
__device__ __forceinline__ uint32_t ternaryCode(float y, float s, float at, const TernaryParams& p, uint64_t i) {
  const bool send = !(s <= FLT_MAX) ||
                    (p.stochastic ? __fmul_rn(compress::counterUniform(p.seed, p.stream, i), s) < fabsf(y)
                                  : fabsf(y) > at);
  return send ? (y >= 0.f ? 1u : 2u) : 0u;
}

__device__ __forceinline__ float decodeCode(uint32_t code, float s) {
  return code == 1u ? s : (code == 2u ? -s : 0.f);
}

// Spreads 4 bits to the even bit positions 0, 2, 4, 6.
__device__ __forceinline__ uint32_t spread4(uint32_t b) {
  return (b & 1u) | ((b & 2u) << 1) | ((b & 4u) << 2) | ((b & 8u) << 3);
}

// Warp-collective block scale from the lanes' partial results (all lanes get it).
__device__ __forceinline__ float blockScale(uint32_t maxBits, float sum, float squares, uint32_t count,
                                            float clip) {
  float s = __uint_as_float(warpMaxU32(maxBits));
  if (clip > 0.f) {
    const float n = __uint2float_rn(count);
    const float mean = __fdiv_rn(warpSumContract(sum), n);
    const float var = __fsub_rn(__fdiv_rn(warpSumContract(squares), n), __fmul_rn(mean, mean));
    const float bound = __fmul_rn(clip, __fsqrt_rn(var < 0.f ? 0.f : var));
    if (bound < s) s = bound;  // a NaN bound (non-finite block) clips nothing
  }
  return s;
}

// Fused encode when blockSize % 4 == 0 (blocks start on code-byte boundaries, so no byte is
// shared between warps). kWriteData = false only computes the scales (generic path).
template <typename XT, bool kWriteData>
__global__ __launch_bounds__(kThreads) void ternaryEncodeKernel(const typename XT::Raw* __restrict__ x,
                                                                float* __restrict__ residual, TernaryParams p) {
  writeHeader(p.payload, p.header);
  const uint32_t lane = threadIdx.x % kWarpSize;
  const uint64_t warpStride = uint64_t(gridDim.x) * kWarpsPerCta;
  for (uint64_t b = uint64_t(blockIdx.x) * kWarpsPerCta + threadIdx.x / kWarpSize; b < p.nblocks; b += warpStride) {
    const uint64_t base = b * p.blockSize;
    const uint32_t count = uint32_t(minOf<uint64_t>(p.blockSize, p.numel - base));
    const uint32_t rounds = (count + kWarpSize - 1) / kWarpSize;
    auto yAt = [&](uint32_t off) { return loadY<XT>(x, residual, base + off); };

    // Pass 1: y of the first rounds into registers (loads issued before use); lane max of |y|
    // bits and, with clipping, lane sums of y and y*y in index order.
    float v[kCachedRounds];
#pragma unroll
    for (uint32_t t = 0; t < kCachedRounds; ++t) {
      const uint32_t off = t * kWarpSize + lane;
      v[t] = off < count ? yAt(off) : 0.f;
    }
    // Every element of the block, in index order per lane (cached rounds from registers).
    auto forEachY = [&](auto&& fn) {
#pragma unroll
      for (uint32_t t = 0; t < kCachedRounds; ++t)
        if (t * kWarpSize + lane < count) fn(v[t]);
      for (uint32_t t = kCachedRounds; t < rounds; ++t)
        if (t * kWarpSize + lane < count) fn(yAt(t * kWarpSize + lane));
    };
    float s, at = 0.f;
    if (p.stochastic) {
      uint32_t maxBits = 0;
      float sum = 0.f, squares = 0.f;
      forEachY([&](float y) {
        maxBits = maxOf(maxBits, __float_as_uint(y) & 0x7fffffffu);
        if (p.clip > 0.f) {
          sum = __fadd_rn(sum, y);
          squares = __fadd_rn(squares, __fmul_rn(y, y));
        }
      });
      s = blockScale(maxBits, sum, squares, count, p.clip);
    } else {
      float abs = 0.f;
      forEachY([&](float y) { abs = __fadd_rn(abs, fabsf(y)); });
      const float mean = __fdiv_rn(warpSumContract(abs), __uint2float_rn(count));
      at = __fmul_rn(mean, p.thresholdFactor);
      float kept = 0.f;
      uint32_t sent = 0;
      forEachY([&](float y) {
        const bool send = fabsf(y) > at;
        kept = __fadd_rn(kept, send ? fabsf(y) : 0.f);
        sent += send;
      });
      const uint32_t sentAll = warpSumU32(sent);
      const float keptAll = warpSumContract(kept);
      s = !(mean <= FLT_MAX) ? mean : sentAll ? __fdiv_rn(keptAll, __uint2float_rn(sentAll)) : 0.f;
      if (p.thresholds && lane == 0) p.thresholds[b] = at;
    }
    if (lane == 0) p.scales[b] = s;
    if (!kWriteData) continue;

    // Pass 2: one ballot pair per 32 elements = 8 code bytes, written by lanes 0..7.
    auto emit = [&](uint32_t t, float y) {
      const uint32_t off = t * kWarpSize + lane;
      const bool in = off < count;
      const uint32_t code = in ? ternaryCode(y, s, at, p, base + off) : 0u;
      if (in && residual) residual[base + off] = residualAfter(y, decodeCode(code, s));
      const uint32_t pos = __ballot_sync(kFullMask, code == 1u);
      const uint32_t neg = __ballot_sync(kFullMask, code == 2u);
      if (lane < 8 && lane * 4 < count - t * kWarpSize) {
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
// ternaryEncodeKernel<..., false> stored the scales, one thread per code byte packs 4 elements.
template <typename XT>
__global__ __launch_bounds__(kThreads) void ternaryPackKernel(const typename XT::Raw* __restrict__ x,
                                                              float* __restrict__ residual, TernaryParams p) {
  const uint64_t bytes = (p.numel + 3) / 4;
  for (uint64_t q = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x; q < bytes; q += uint64_t(gridDim.x) * blockDim.x) {
    uint32_t byte = 0;
    for (uint32_t e = 0; e < 4; ++e) {
      const uint64_t i = q * 4 + e;
      if (i >= p.numel) break;
      const float s = p.scales[i / p.blockSize];
      const float at = p.thresholds ? p.thresholds[i / p.blockSize] : 0.f;
      const float y = loadY<XT>(x, residual, i);
      const uint32_t code = ternaryCode(y, s, at, p, i);
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
  const uint32_t lane = threadIdx.x % kWarpSize;
  const uint64_t warpStride = uint64_t(gridDim.x) * kWarpsPerCta;
  for (uint64_t b = uint64_t(blockIdx.x) * kWarpsPerCta + threadIdx.x / kWarpSize; b < nblocks; b += warpStride) {
    const uint64_t base = b * blockSize;
    const uint32_t count = uint32_t(minOf<uint64_t>(blockSize, numel - base));
    const float s = scales[b];
    // 8 rounds at a time, the accumulator loads first, so that they are in flight together.
    for (uint32_t off0 = 0; off0 < count; off0 += kDecodeBatch * kWarpSize) {
      float prev[kDecodeBatch];
#pragma unroll
      for (uint32_t q = 0; q < kDecodeBatch; ++q) {
        const uint32_t off = off0 + q * kWarpSize + lane;
        prev[q] = kAcc && off < count ? out[base + off] : 0.f;
      }
#pragma unroll
      for (uint32_t q = 0; q < kDecodeBatch; ++q) {
        const uint32_t off = off0 + q * kWarpSize + lane;
        if (off >= count) break;
        const uint64_t i = base + off;
        const float d = decodeCode((codes[i >> 2] >> (2 * (i & 3))) & 3u, s);
        if (kAcc) {
          out[i] = __fadd_rn(prev[q], d);
        } else {
          out[i] = OutT::fromFloat(d);
        }
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
  p.stochastic = a.config.stochastic;
  p.thresholdFactor = compress::kTernaryThreshold;
  p.clip = a.config.clip;
  p.seed = a.config.seed;
  p.stream = a.stream;
  p.scales = reinterpret_cast<float*>(a.payload + a.layout.first);
  p.codes = a.payload + a.layout.second;
  // The generic path packs codes in a second kernel, which needs the deterministic threshold.
  p.thresholds = !p.stochastic && p.blockSize % 4 != 0 ? static_cast<float*>(a.workspace) : nullptr;
  p.payload = a.payload;
  p.header = a.header;
  const auto* x = static_cast<const typename XT::Raw*>(a.x);
  const uint64_t grid = gridFor(p.nblocks, kWarpsPerCta);
  if (grid == 0) {
    launch(writeHeaderKernel, 1, 32, a.cudaStream, a.payload, a.header);
  } else if (p.blockSize % 4 == 0) {
    launch(ternaryEncodeKernel<XT, true>, grid, kThreads, a.cudaStream, x, a.residual, p);
  } else {
    launch(ternaryEncodeKernel<XT, false>, grid, kThreads, a.cudaStream, x, a.residual, p);
    launch(ternaryPackKernel<XT>, gridFor((p.numel + 3) / 4, kThreads), kThreads, a.cudaStream, x, a.residual, p);
  }
}

template <typename OutT, bool kAcc>
void decodeTyped(const DecodeArgs& a) {
  launch(ternaryDecodeKernel<OutT, kAcc>, gridFor(a.layout.nblocks, kWarpsPerCta), kThreads, a.cudaStream,
         reinterpret_cast<const float*>(a.payload + a.layout.first), a.payload + a.layout.second, a.numel,
         a.layout.nblocks, a.blockSize, static_cast<typename OutT::Raw*>(a.out));
}

}  // namespace

size_t ternaryWorkspaceBytes(const compress::Config& config, uint64_t numel) {
  if (config.stochastic || config.blockSize % 4 == 0) return 0;
  return size_t((numel + config.blockSize - 1) / config.blockSize) * sizeof(float);
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
