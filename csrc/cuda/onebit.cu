// 1-bit compression with error feedback (single scale = mean |y| per block, or 1-bit SGD's two
// scales: mean of y >= 0 and mean |y| of y < 0). One warp per scale block: lane j owns
// elements j, j+32, ... of the block, which is exactly the contract's 32-lane summation, so
// the block sum is the warp's shuffle tree and the whole encode is one pass over x and the
// residual (a 256-element block stays in registers between the sum and the sign pass).
#include "cuda/common.cuh"
#include "cuda/launchers.h"

namespace ddlcomm::gpu::detail {
namespace {

constexpr int kThreads = 256;
constexpr int kWarpsPerCta = kThreads / kWarpSize;
constexpr uint32_t kCachedRounds = 8;  // 8 rounds of 32 elements: the default 256-element block
constexpr uint32_t kDecodeBatch = 8;

struct OneBitParams {
  uint64_t numel;
  uint64_t nblocks;
  uint32_t blockSize;
  float* scales;       // in the payload
  uint8_t* signs;      // in the payload
  uint8_t* payload;    // header destination
  HeaderWords header;
};

template <bool kTwo>
struct Sums {
  float pos = 0.f;  // single scale: sum |y|
  float neg = 0.f;  // two scales: sum |y| over y < 0 (and NaN)
  uint32_t npos = 0;

  __device__ __forceinline__ void add(float y) {
    if (kTwo) {
      if (y >= 0.f) {
        pos = __fadd_rn(pos, y);
        ++npos;
      } else {
        neg = __fadd_rn(neg, fabsf(y));
      }
    } else {
      pos = __fadd_rn(pos, fabsf(y));
    }
  }
};

struct Scales {
  float pos, neg;  // decoded value: y >= 0 ? pos : -neg
};

// Warp-collective: every lane passes its partial sums; all lanes get the block's scales.
template <bool kTwo>
__device__ __forceinline__ Scales finishScales(const Sums<kTwo>& s, uint32_t count) {
  const float pos = warpSumContract(s.pos);
  if (!kTwo) {
    const float mean = __fdiv_rn(pos, __uint2float_rn(count));
    return {mean, mean};
  }
  const float neg = warpSumContract(s.neg);
  const uint32_t npos = warpSumU32(s.npos);
  const uint32_t nneg = count - npos;
  return {npos ? __fdiv_rn(pos, __uint2float_rn(npos)) : 0.f, nneg ? __fdiv_rn(neg, __uint2float_rn(nneg)) : 0.f};
}

__device__ __forceinline__ float decodeBit(bool bit, Scales s) { return bit ? s.pos : -s.neg; }

// Fused encode when blockSize % 8 == 0 (blocks start on sign-byte boundaries, so no byte is
// shared between warps). kWriteData = false only computes the scales (for the generic path).
template <typename XT, bool kTwo, bool kWriteData>
__global__ __launch_bounds__(kThreads) void onebitEncodeKernel(const typename XT::Raw* __restrict__ x,
                                                               float* __restrict__ residual, OneBitParams p) {
  writeHeader(p.payload, p.header);
  const int lane = threadIdx.x % kWarpSize;
  const uint64_t warpStride = uint64_t(gridDim.x) * kWarpsPerCta;
  for (uint64_t b = uint64_t(blockIdx.x) * kWarpsPerCta + threadIdx.x / kWarpSize; b < p.nblocks; b += warpStride) {
    const uint64_t base = b * p.blockSize;
    const uint32_t count = uint32_t(minOf<uint64_t>(p.blockSize, p.numel - base));
    const uint32_t rounds = (count + kWarpSize - 1) / kWarpSize;

    // Pass 1: y for the first rounds into registers (all loads issued before the first use),
    // lane partial sums in index order.
    float v[kCachedRounds];
#pragma unroll
    for (uint32_t t = 0; t < kCachedRounds; ++t) {
      const uint32_t off = t * kWarpSize + lane;
      v[t] = off < count ? loadY<XT>(x, residual, base + off) : 0.f;
    }
    Sums<kTwo> sums;
#pragma unroll
    for (uint32_t t = 0; t < kCachedRounds; ++t)
      if (t * kWarpSize + lane < count) sums.add(v[t]);
    for (uint32_t t = kCachedRounds; t < rounds; ++t) {
      const uint32_t off = t * kWarpSize + lane;
      if (off < count) sums.add(loadY<XT>(x, residual, base + off));
    }
    const Scales s = finishScales<kTwo>(sums, count);
    if (lane == 0) {
      if (kTwo) {
        p.scales[2 * b] = s.pos;
        p.scales[2 * b + 1] = s.neg;
      } else {
        p.scales[b] = s.pos;
      }
    }
    if (!kWriteData) continue;

    // Pass 2: signs (one ballot per 32 elements = 4 payload bytes) and the residual.
    auto emit = [&](uint32_t t, float y) {
      const uint32_t off = t * kWarpSize + lane;
      const bool in = off < count;
      const bool bit = in && y >= 0.f;
      if (in && residual) residual[base + off] = residualAfter(y, decodeBit(bit, s));
      const uint32_t word = __ballot_sync(kFullMask, bit);
      if (lane < 4 && uint32_t(lane) * 8 < count - t * kWarpSize)
        p.signs[(base + t * kWarpSize) / 8 + lane] = uint8_t(word >> (8 * lane));
    };
#pragma unroll
    for (uint32_t t = 0; t < kCachedRounds; ++t)
      if (t < rounds) emit(t, v[t]);
    for (uint32_t t = kCachedRounds; t < rounds; ++t) {
      const uint32_t off = t * kWarpSize + lane;
      emit(t, off < count ? loadY<XT>(x, residual, base + off) : 0.f);
    }
  }
}

// Generic path (blockSize % 8 != 0): after onebitEncodeKernel<..., false> stored the scales,
// one thread per sign byte packs 8 elements, reading the scales back from the payload.
template <typename XT, bool kTwo>
__global__ __launch_bounds__(kThreads) void onebitPackKernel(const typename XT::Raw* __restrict__ x,
                                                             float* __restrict__ residual, OneBitParams p) {
  const uint64_t bytes = (p.numel + 7) / 8;
  for (uint64_t q = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x; q < bytes; q += uint64_t(gridDim.x) * blockDim.x) {
    uint32_t byte = 0;
    for (uint32_t e = 0; e < 8; ++e) {
      const uint64_t i = q * 8 + e;
      if (i >= p.numel) break;
      const uint64_t b = i / p.blockSize;
      const Scales s = kTwo ? Scales{p.scales[2 * b], p.scales[2 * b + 1]} : Scales{p.scales[b], p.scales[b]};
      const float y = loadY<XT>(x, residual, i);
      const bool bit = y >= 0.f;
      if (residual) residual[i] = residualAfter(y, decodeBit(bit, s));
      byte |= uint32_t(bit) << e;
    }
    p.signs[q] = uint8_t(byte);
  }
}

template <typename XT, bool kTwo>
void encodeTyped(const EncodeArgs& a) {
  OneBitParams p;
  p.numel = a.numel;
  p.nblocks = a.layout.nblocks;
  p.blockSize = a.config.blockSize;
  p.scales = reinterpret_cast<float*>(a.payload + a.layout.first);
  p.signs = a.payload + a.layout.second;
  p.payload = a.payload;
  p.header = a.header;
  const auto* x = static_cast<const typename XT::Raw*>(a.x);
  const uint64_t grid = gridFor(p.nblocks, kWarpsPerCta);
  if (grid == 0) {  // numel == 0: the header is the whole payload
    launch(writeHeaderKernel, 1, 32, a.cudaStream, a.payload, a.header);
  } else if (p.blockSize % 8 == 0) {
    launch(onebitEncodeKernel<XT, kTwo, true>, grid, kThreads, a.cudaStream, x, a.residual, p);
  } else {
    launch(onebitEncodeKernel<XT, kTwo, false>, grid, kThreads, a.cudaStream, x, a.residual, p);
    launch(onebitPackKernel<XT, kTwo>, gridFor((p.numel + 7) / 8, kThreads), kThreads, a.cudaStream, x, a.residual,
           p);
  }
}

template <bool kTwo>
void encodeTwo(const EncodeArgs& a) {
  switch (a.xType) {
    case DataType::Float16: return encodeTyped<F16, kTwo>(a);
    case DataType::BFloat16: return encodeTyped<BF16, kTwo>(a);
    default: return encodeTyped<F32, kTwo>(a);
  }
}

// Decode: one warp per scale block (any block size), lanes over its elements.
template <typename OutT, bool kAcc, bool kTwo>
__global__ __launch_bounds__(kThreads) void onebitDecodeKernel(const float* __restrict__ scales,
                                                               const uint8_t* __restrict__ signs, uint64_t numel,
                                                               uint64_t nblocks, uint32_t blockSize,
                                                               typename OutT::Raw* __restrict__ out) {
  const uint32_t lane = threadIdx.x % kWarpSize;
  const uint64_t warpStride = uint64_t(gridDim.x) * kWarpsPerCta;
  for (uint64_t b = uint64_t(blockIdx.x) * kWarpsPerCta + threadIdx.x / kWarpSize; b < nblocks; b += warpStride) {
    const uint64_t base = b * blockSize;
    const uint32_t count = uint32_t(minOf<uint64_t>(blockSize, numel - base));
    const Scales s = kTwo ? Scales{scales[2 * b], scales[2 * b + 1]} : Scales{scales[b], scales[b]};
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
        const float d = decodeBit((signs[i >> 3] >> (i & 7)) & 1u, s);
        if (kAcc) {
          out[i] = __fadd_rn(prev[q], d);
        } else {
          out[i] = OutT::fromFloat(d);
        }
      }
    }
  }
}

template <typename OutT, bool kAcc>
void decodeTyped(const DecodeArgs& a) {
  const auto* scales = reinterpret_cast<const float*>(a.payload + a.layout.first);
  const uint8_t* signs = a.payload + a.layout.second;
  auto* out = static_cast<typename OutT::Raw*>(a.out);
  const uint64_t grid = gridFor(a.layout.nblocks, kWarpsPerCta);
  if (a.twoScales) {
    launch(onebitDecodeKernel<OutT, kAcc, true>, grid, kThreads, a.cudaStream, scales, signs, a.numel,
           a.layout.nblocks, a.blockSize, out);
  } else {
    launch(onebitDecodeKernel<OutT, kAcc, false>, grid, kThreads, a.cudaStream, scales, signs, a.numel,
           a.layout.nblocks, a.blockSize, out);
  }
}

}  // namespace

void encodeOneBit(const EncodeArgs& a) {
  if (a.config.twoScales) {
    encodeTwo<true>(a);
  } else {
    encodeTwo<false>(a);
  }
}

void decodeOneBit(const DecodeArgs& a) {
  if (a.accumulate) return decodeTyped<F32, true>(a);
  switch (a.outType) {
    case DataType::Float16: return decodeTyped<F16, false>(a);
    case DataType::BFloat16: return decodeTyped<BF16, false>(a);
    default: return decodeTyped<F32, false>(a);
  }
}

}  // namespace ddlcomm::gpu::detail
