// The kernels shared by the block formats, 1-bit (onebit.cu) and ternary (ternary.cu). One warp
// per scale block: lane j owns elements j, j+32, ... of the block, which is exactly the
// contract's 32-lane summation, so a block's sums are the warp's shuffle tree and the whole
// encode is one pass over x and the residual (a 256-element block stays in registers between
// the scale and the codes). A format supplies a small policy Code:
//   kFormat                        its Format (code bits and scale layout: wire_format.h)
//   Params                         its own kernel parameters
//   Scale                          what a block's codes decode against
//   blockScale(f, forEachY, count) warp-collective: every lane gets the block's Scale;
//                                  forEachY(fn) calls fn(y) for the lane's elements in order
//   storeScale(scales, f, b, s)    block b's scales (called by lane 0)
//   loadScale(scales, f, b)        read back (the pack path; decoding passes Params{})
//   code(y, s, f, i)               the code of element i
//   decode(code, s)                the value a code decodes to
#pragma once

#include "cuda/common.cuh"
#include "cuda/launchers.h"

namespace ddlcomm::gpu::detail::blocks {

constexpr int kThreads = 256;
constexpr int kWarpsPerCta = kThreads / kWarpSize;
constexpr uint32_t kCachedRounds = 8;  // 8 rounds of 32 elements: the default 256-element block
constexpr uint32_t kDecodeBatch = 8;

struct Params {
  uint64_t numel;
  uint64_t nblocks;
  uint32_t blockSize;
  float* scales;     // in the payload
  uint8_t* codes;    // in the payload
  uint8_t* payload;  // header destination
  HeaderWords header;
};

template <class Code>
constexpr uint32_t kBits = compress::codeBits(Code::kFormat);
template <class Code>
constexpr uint32_t kPerByte = 8 / kBits<Code>;  // elements per code byte

// Code byte `lane` of a round of 32 elements, from the ballots of the codes' bit planes.
template <uint32_t kCodeBits>
__device__ __forceinline__ uint32_t codeByte(const uint32_t (&plane)[kCodeBits], uint32_t lane) {
  if constexpr (kCodeBits == 1) {
    return (plane[0] >> (8 * lane)) & 0xffu;
  } else {
    // 2-bit codes: bit planes 0 and 1 of elements 4 lane .. 4 lane + 3, interleaved.
    auto spread4 = [](uint32_t b) { return (b & 1u) | ((b & 2u) << 1) | ((b & 4u) << 2) | ((b & 8u) << 3); };
    return spread4((plane[0] >> (4 * lane)) & 0xfu) | (spread4((plane[1] >> (4 * lane)) & 0xfu) << 1);
  }
}

// Fused encode when blockSize % kPerByte == 0 (blocks start on code-byte boundaries, so no
// byte is shared between warps). kWriteData = false only stores the scales (generic path).
template <class Code, typename XT, bool kWriteData>
__global__ __launch_bounds__(kThreads) void encodeKernel(const typename XT::Raw* __restrict__ x,
                                                         float* __restrict__ residual, Params p,
                                                         typename Code::Params f) {
  constexpr uint32_t kCodeBits = kBits<Code>, kPer = kPerByte<Code>;
  writeHeader(p.payload, p.header);
  const uint32_t lane = threadIdx.x % kWarpSize;
  const uint64_t warpStride = uint64_t(gridDim.x) * kWarpsPerCta;
  for (uint64_t b = uint64_t(blockIdx.x) * kWarpsPerCta + threadIdx.x / kWarpSize; b < p.nblocks; b += warpStride) {
    const uint64_t base = b * p.blockSize;
    const uint32_t count = uint32_t(minOf<uint64_t>(p.blockSize, p.numel - base));
    const uint32_t rounds = (count + kWarpSize - 1) / kWarpSize;
    auto yAt = [&](uint32_t off) { return loadY<XT>(x, residual, base + off); };

    // Pass 1: y of the first rounds into registers (all loads issued before the first use).
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
    const typename Code::Scale s = Code::blockScale(f, forEachY, count);
    if (lane == 0) Code::storeScale(p.scales, f, b, s);
    if (!kWriteData) continue;

    // Pass 2: the codes (one ballot per bit plane per 32 elements) and the residual.
    auto emit = [&](uint32_t t, float y) {
      const uint32_t off = t * kWarpSize + lane;
      const bool in = off < count;
      const uint32_t code = in ? Code::code(y, s, f, base + off) : 0u;
      if (in && residual) residual[base + off] = residualAfter(y, Code::decode(code, s));
      uint32_t plane[kCodeBits];
#pragma unroll
      for (uint32_t bit = 0; bit < kCodeBits; ++bit) plane[bit] = __ballot_sync(kFullMask, (code >> bit) & 1u);
      if (lane < kWarpSize / kPer && lane * kPer < count - t * kWarpSize)
        p.codes[(base + t * kWarpSize) / kPer + lane] = uint8_t(codeByte<kCodeBits>(plane, lane));
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

// Generic path (blockSize % kPerByte != 0, where a code byte can span two blocks): after
// encodeKernel<..., false> stored the scales, one thread per code byte packs its elements.
template <class Code, typename XT>
__global__ __launch_bounds__(kThreads) void packKernel(const typename XT::Raw* __restrict__ x,
                                                       float* __restrict__ residual, Params p,
                                                       typename Code::Params f) {
  constexpr uint32_t kPer = kPerByte<Code>;
  const uint64_t bytes = (p.numel + kPer - 1) / kPer;
  for (uint64_t q = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x; q < bytes; q += uint64_t(gridDim.x) * blockDim.x) {
    uint32_t byte = 0;
    for (uint32_t e = 0; e < kPer; ++e) {
      const uint64_t i = q * kPer + e;
      if (i >= p.numel) break;
      const typename Code::Scale s = Code::loadScale(p.scales, f, i / p.blockSize);
      const float y = loadY<XT>(x, residual, i);
      const uint32_t code = Code::code(y, s, f, i);
      if (residual) residual[i] = residualAfter(y, Code::decode(code, s));
      byte |= code << (kBits<Code> * e);
    }
    p.codes[q] = uint8_t(byte);
  }
}

// Decode: one warp per scale block (any block size), lanes over its elements.
template <class Code, typename OutT, bool kAcc>
__global__ __launch_bounds__(kThreads) void decodeKernel(const float* __restrict__ scales,
                                                         const uint8_t* __restrict__ codes, uint64_t numel,
                                                         uint64_t nblocks, uint32_t blockSize,
                                                         typename OutT::Raw* __restrict__ out) {
  constexpr uint32_t kCodeBits = kBits<Code>, kPer = kPerByte<Code>;
  const uint32_t lane = threadIdx.x % kWarpSize;
  const uint64_t warpStride = uint64_t(gridDim.x) * kWarpsPerCta;
  for (uint64_t b = uint64_t(blockIdx.x) * kWarpsPerCta + threadIdx.x / kWarpSize; b < nblocks; b += warpStride) {
    const uint64_t base = b * blockSize;
    const uint32_t count = uint32_t(minOf<uint64_t>(blockSize, numel - base));
    const typename Code::Scale s = Code::loadScale(scales, typename Code::Params{}, b);
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
        const float d = Code::decode((codes[i / kPer] >> (kCodeBits * (i % kPer))) & ((1u << kCodeBits) - 1u), s);
        if (kAcc) {
          out[i] = __fadd_rn(prev[q], d);
        } else {
          out[i] = OutT::fromFloat(d);
        }
      }
    }
  }
}

template <class Code>
void encode(const EncodeArgs& a, const typename Code::Params& f) {
  constexpr uint32_t kPer = kPerByte<Code>;
  const Params p{a.numel,
                 a.layout.nblocks,
                 a.config.blockSize,
                 reinterpret_cast<float*>(a.payload + a.layout.first),
                 a.payload + a.layout.second,
                 a.payload,
                 a.header};
  const uint64_t grid = gridFor(p.nblocks, kWarpsPerCta);
  withFloatType(a.xType, [&](auto xt) {
    using XT = decltype(xt);
    const auto* x = static_cast<const typename XT::Raw*>(a.x);
    if (grid == 0) {  // numel == 0: the header is the whole payload
      launch(writeHeaderKernel, 1, 32, a.cudaStream, a.payload, a.header);
    } else if (p.blockSize % kPer == 0) {
      launch(encodeKernel<Code, XT, true>, grid, kThreads, a.cudaStream, x, a.residual, p, f);
    } else {
      launch(encodeKernel<Code, XT, false>, grid, kThreads, a.cudaStream, x, a.residual, p, f);
      launch(packKernel<Code, XT>, gridFor((p.numel + kPer - 1) / kPer, kThreads), kThreads, a.cudaStream, x,
             a.residual, p, f);
    }
  });
}

template <class Code>
void decode(const DecodeArgs& a) {
  withOutput(a.accumulate, a.outType, [&](auto outT, auto acc) {
    using OutT = decltype(outT);
    launch(decodeKernel<Code, OutT, decltype(acc)::value>, gridFor(a.layout.nblocks, kWarpsPerCta), kThreads,
           a.cudaStream, reinterpret_cast<const float*>(a.payload + a.layout.first), a.payload + a.layout.second,
           a.numel, a.layout.nblocks, a.blockSize, static_cast<typename OutT::Raw*>(a.out));
  });
}

}  // namespace ddlcomm::gpu::detail::blocks
