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
//   code(y, s, f, stream, i)       the code of element i of a chunk encoded with randomness stream
//   decode(code, s)                the value a code decodes to
// A launch takes a table of chunks (common.cuh's Parts); a warp finds its scale block's chunk.
#pragma once

#include "cuda/common.cuh"
#include "cuda/launchers.h"

namespace ddlcomm::gpu::detail::blocks {

constexpr int kThreads = 256;
constexpr int kWarpsPerCta = kThreads / kWarpSize;
constexpr uint32_t kCachedRounds = 8;  // 8 rounds of 32 elements: the default 256-element block
constexpr uint32_t kDecodeBatch = 8;

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
__global__ __launch_bounds__(kThreads) void encodeKernel(const __grid_constant__ Parts<EncodePart> p,
                                                         const uint32_t blockSize, const typename Code::Params f) {
  constexpr uint32_t kCodeBits = kBits<Code>, kPer = kPerByte<Code>;
  writeHeaders(p);
  const uint32_t lane = threadIdx.x % kWarpSize;
  const uint64_t warpStride = uint64_t(gridDim.x) * kWarpsPerCta;
  for (uint64_t g = uint64_t(blockIdx.x) * kWarpsPerCta + threadIdx.x / kWarpSize; g < p.start[p.count];
       g += warpStride) {
    const uint32_t j = partOf(p, g);
    const EncodePart& q = p.part[j];
    const uint64_t b = g - p.start[j];
    const auto* __restrict__ x = static_cast<const typename XT::Raw*>(q.x);
    float* __restrict__ residual = q.residual;
    uint8_t* __restrict__ codes = q.payload + q.second;
    const uint64_t base = b * blockSize;
    const uint32_t count = uint32_t(minOf<uint64_t>(blockSize, q.numel - base));
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
    if (lane == 0) Code::storeScale(reinterpret_cast<float*>(q.payload + q.first), f, b, s);
    if (!kWriteData) continue;

    // Pass 2: the codes (one ballot per bit plane per 32 elements) and the residual.
    auto emit = [&](uint32_t t, float y) {
      const uint32_t off = t * kWarpSize + lane;
      const bool in = off < count;
      const uint32_t code = in ? Code::code(y, s, f, q.stream, base + off) : 0u;
      if (in && residual) residual[base + off] = residualAfter(y, Code::decode(code, s));
      uint32_t plane[kCodeBits];
#pragma unroll
      for (uint32_t bit = 0; bit < kCodeBits; ++bit) plane[bit] = __ballot_sync(kFullMask, (code >> bit) & 1u);
      if (lane < kWarpSize / kPer && lane * kPer < count - t * kWarpSize)
        codes[(base + t * kWarpSize) / kPer + lane] = uint8_t(codeByte<kCodeBits>(plane, lane));
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

// Generic path (blockSize % kPerByte != 0, where a code byte can span two blocks), one chunk
// a launch: after encodeKernel<..., false> stored the scales, one thread per code byte packs
// its elements.
template <class Code, typename XT>
__global__ __launch_bounds__(kThreads) void packKernel(const __grid_constant__ EncodePart q, const uint32_t blockSize,
                                                       const typename Code::Params f) {
  constexpr uint32_t kPer = kPerByte<Code>;
  const auto* __restrict__ x = static_cast<const typename XT::Raw*>(q.x);
  const float* scales = reinterpret_cast<const float*>(q.payload + q.first);
  const uint64_t bytes = (q.numel + kPer - 1) / kPer;
  for (uint64_t c = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x; c < bytes; c += uint64_t(gridDim.x) * blockDim.x) {
    uint32_t byte = 0;
    for (uint32_t e = 0; e < kPer; ++e) {
      const uint64_t i = c * kPer + e;
      if (i >= q.numel) break;
      const typename Code::Scale s = Code::loadScale(scales, f, i / blockSize);
      const float y = loadY<XT>(x, q.residual, i);
      const uint32_t code = Code::code(y, s, f, q.stream, i);
      if (q.residual) q.residual[i] = residualAfter(y, Code::decode(code, s));
      byte |= code << (kBits<Code> * e);
    }
    q.payload[q.second + c] = uint8_t(byte);
  }
}

// The code of element i of a payload's codes.
template <class Code>
__device__ __forceinline__ uint32_t codeAt(const uint8_t* codes, uint64_t i) {
  constexpr uint32_t kCodeBits = kBits<Code>, kPer = kPerByte<Code>;
  return (codes[i / kPer] >> (kCodeBits * (i % kPer))) & ((1u << kCodeBits) - 1u);
}

// Decode: one warp per scale block (any block size), lanes over its elements.
template <class Code, typename OutT, bool kAcc>
__global__ __launch_bounds__(kThreads) void decodeKernel(const __grid_constant__ Parts<DecodePart> p,
                                                         const uint32_t blockSize) {
  const uint32_t lane = threadIdx.x % kWarpSize;
  const uint64_t warpStride = uint64_t(gridDim.x) * kWarpsPerCta;
  for (uint64_t g = uint64_t(blockIdx.x) * kWarpsPerCta + threadIdx.x / kWarpSize; g < p.start[p.count];
       g += warpStride) {
    const uint32_t j = partOf(p, g);
    const DecodePart& q = p.part[j];
    const uint64_t b = g - p.start[j];
    const uint8_t* __restrict__ codes = q.payload + q.second;
    auto* __restrict__ out = static_cast<typename OutT::Raw*>(q.out);
    const uint64_t base = b * blockSize;
    const uint32_t count = uint32_t(minOf<uint64_t>(blockSize, q.numel - base));
    const typename Code::Scale s =
        Code::loadScale(reinterpret_cast<const float*>(q.payload + q.first), typename Code::Params{}, b);
    // 8 rounds at a time, the accumulator loads first, so that they are in flight together.
    for (uint32_t off0 = 0; off0 < count; off0 += kDecodeBatch * kWarpSize) {
      float prev[kDecodeBatch];
#pragma unroll
      for (uint32_t t = 0; t < kDecodeBatch; ++t) {
        const uint32_t off = off0 + t * kWarpSize + lane;
        prev[t] = kAcc && off < count ? out[base + off] : 0.f;
      }
#pragma unroll
      for (uint32_t t = 0; t < kDecodeBatch; ++t) {
        const uint32_t off = off0 + t * kWarpSize + lane;
        if (off >= count) break;
        const uint64_t i = base + off;
        const float d = Code::decode(codeAt<Code>(codes, i), s);
        if (kAcc) {
          out[i] = __fadd_rn(prev[t], d);
        } else {
          out[i] = OutT::fromFloat(d);
        }
      }
    }
  }
}

// out = scale * the sum of every part's payload decoded, in part order, from 0 (fromZero) or
// from out (a later table of the same sum). Every part has the same numel; one warp per
// scale block, lanes over its elements.
template <class Code>
__global__ __launch_bounds__(kThreads) void sumKernel(const __grid_constant__ Parts<DecodePart> p,
                                                      const uint32_t blockSize, const bool fromZero, const float scale,
                                                      float* __restrict__ out) {
  const uint64_t numel = p.part[0].numel;
  const uint32_t lane = threadIdx.x % kWarpSize;
  const uint64_t warpStride = uint64_t(gridDim.x) * kWarpsPerCta;
  for (uint64_t b = uint64_t(blockIdx.x) * kWarpsPerCta + threadIdx.x / kWarpSize; b < p.start[1];
       b += warpStride) {
    const uint64_t base = b * blockSize;
    const uint32_t count = uint32_t(minOf<uint64_t>(blockSize, numel - base));
    for (uint32_t off = lane; off < count; off += kWarpSize) {
      const uint64_t i = base + off;
      float sum = fromZero ? 0.f : out[i];
      for (uint32_t j = 0; j < p.count; ++j) {
        const DecodePart& q = p.part[j];
        const typename Code::Scale s =
            Code::loadScale(reinterpret_cast<const float*>(q.payload + q.first), typename Code::Params{}, b);
        sum = __fadd_rn(sum, Code::decode(codeAt<Code>(q.payload + q.second, i), s));
      }
      out[i] = scale == 1.f ? sum : __fmul_rn(sum, scale);
    }
  }
}

// A chunk's work items in a launch's table: its scale blocks (its payload layout's).
template <class Args>
uint64_t scaleBlocks(const Args& chunk) {
  return chunk.layout.nblocks;
}

template <class Code>
void encode(const EncodeArgs* a, size_t n, const typename Code::Params& f) {
  constexpr uint32_t kPer = kPerByte<Code>;
  const uint32_t blockSize = a[0].config.blockSize;
  withFloatType(a[0].xType, [&](auto xt) {
    using XT = decltype(xt);
    if (blockSize % kPer == 0) {
      inTables<EncodePart>(a, n, encodePartOf, scaleBlocks<EncodeArgs>, [&](const Parts<EncodePart>& p) {
        // At least one CTA: block 0 writes the headers, of empty chunks too.
        const uint64_t grid = maxOf<uint64_t>(1, gridFor(p.start[p.count], kWarpsPerCta));
        launch(encodeKernel<Code, XT, true>, grid, kThreads, a[0].cudaStream, p, blockSize, f);
      });
      return;
    }
    for (size_t i = 0; i < n; ++i) {  // the generic path, a chunk at a time
      inTables<EncodePart>(a + i, 1, encodePartOf, scaleBlocks<EncodeArgs>, [&](const Parts<EncodePart>& p) {
        const uint64_t grid = maxOf<uint64_t>(1, gridFor(p.start[1], kWarpsPerCta));
        launch(encodeKernel<Code, XT, false>, grid, kThreads, a[i].cudaStream, p, blockSize, f);
      });
      launch(packKernel<Code, XT>, gridFor((a[i].numel + kPer - 1) / kPer, kThreads), kThreads, a[i].cudaStream,
             encodePartOf(a[i]), blockSize, f);
    }
  });
}

template <class Code>
void decode(const DecodeArgs* a, size_t n) {
  const uint32_t blockSize = a[0].blockSize;
  withOutput(a[0].accumulate, a[0].outType, [&](auto outT, auto acc) {
    inTables<DecodePart>(a, n, decodePartOf, scaleBlocks<DecodeArgs>,
                         [&](const Parts<DecodePart>& p) {
                           launch(decodeKernel<Code, decltype(outT), decltype(acc)::value>,
                                  gridFor(p.start[p.count], kWarpsPerCta), kThreads, a[0].cudaStream, p, blockSize);
                         });
  });
}

template <class Code>
void sum(const DecodeArgs* a, size_t n, float scale, float* out) {
  const uint32_t blockSize = a[0].blockSize;
  sumInTables(a, n, scale, scaleBlocks<DecodeArgs>,
              [&](const Parts<DecodePart>& p, bool fromZero, float s) {
                launch(sumKernel<Code>, gridFor(p.start[1], kWarpsPerCta), kThreads, a[0].cudaStream, p, blockSize,
                       fromZero, s, out);
              });
}

}  // namespace ddlcomm::gpu::detail::blocks
