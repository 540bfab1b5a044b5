// float16 / bfloat16 "compression" (a plain cast, round to nearest even) with error feedback:
// residual = y - float(cast(y)). Elementwise; each thread keeps 4 independent loads in flight.
#include "cuda/common.cuh"
#include "cuda/launchers.h"

namespace ddlcomm::gpu {

// Declared in common.cuh: the header alone, for encodes of 0 elements.
__global__ void writeHeaderKernel(uint8_t* payload, HeaderWords h) { writeHeader(payload, h); }

namespace detail {
namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 4;

// Elements are visited as i = start + j * stride (j < kUnroll) so every load is coalesced.
template <typename XT, typename PT>
__global__ __launch_bounds__(kThreads) void castEncodeKernel(const typename XT::Raw* __restrict__ x,
                                                             float* __restrict__ residual, uint64_t numel,
                                                             uint16_t* __restrict__ values, uint8_t* payload,
                                                             HeaderWords header) {
  writeHeader(payload, header);
  const uint64_t stride = uint64_t(gridDim.x) * blockDim.x;
  for (uint64_t start = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x; start < numel; start += stride * kUnroll) {
    float y[kUnroll];
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) {
      const uint64_t i = start + j * stride;
      y[j] = i < numel ? loadY<XT>(x, residual, i) : 0.f;
    }
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) {
      const uint64_t i = start + j * stride;
      if (i >= numel) break;
      const uint16_t h = PT::fromFloat(y[j]);
      values[i] = h;
      if (residual) residual[i] = residualAfter(y[j], PT::toFloat(h));
    }
  }
}

template <typename PT, typename OutT, bool kAcc>
__global__ __launch_bounds__(kThreads) void castDecodeKernel(const uint16_t* __restrict__ values, uint64_t numel,
                                                             typename OutT::Raw* __restrict__ out) {
  const uint64_t stride = uint64_t(gridDim.x) * blockDim.x;
  for (uint64_t start = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x; start < numel; start += stride * kUnroll) {
    uint16_t v[kUnroll];
    float prev[kUnroll];
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) {
      const uint64_t i = start + j * stride;
      v[j] = i < numel ? values[i] : 0;
      prev[j] = kAcc && i < numel ? out[i] : 0.f;
    }
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) {
      const uint64_t i = start + j * stride;
      if (i >= numel) break;
      const float d = PT::toFloat(v[j]);
      if (kAcc) {
        out[i] = __fadd_rn(prev[j], d);
      } else {
        out[i] = OutT::fromFloat(d);
      }
    }
  }
}

template <typename XT, typename PT>
void encodeTyped(const EncodeArgs& a) {
  const uint64_t grid = gridFor(a.numel, uint64_t(kThreads) * kUnroll);
  auto* values = reinterpret_cast<uint16_t*>(a.payload + a.layout.first);
  if (grid == 0) {
    launch(writeHeaderKernel, 1, 32, a.cudaStream, a.payload, a.header);
  } else {
    launch(castEncodeKernel<XT, PT>, grid, kThreads, a.cudaStream, static_cast<const typename XT::Raw*>(a.x),
           a.residual, a.numel, values, a.payload, a.header);
  }
}

template <typename PT>
void encodeFormat(const EncodeArgs& a) {
  withFloatType(a.xType, [&](auto xt) { encodeTyped<decltype(xt), PT>(a); });
}

template <typename PT>
void decodeFormat(const DecodeArgs& a) {
  withOutput(a.accumulate, a.outType, [&](auto outT, auto acc) {
    using OutT = decltype(outT);
    launch(castDecodeKernel<PT, OutT, decltype(acc)::value>, gridFor(a.numel, uint64_t(kThreads) * kUnroll), kThreads,
           a.cudaStream, reinterpret_cast<const uint16_t*>(a.payload + a.layout.first), a.numel,
           static_cast<typename OutT::Raw*>(a.out));
  });
}

}  // namespace

void encodeCast(const EncodeArgs& a) {
  if (a.config.format == compress::Format::BFloat16) {
    encodeFormat<BF16>(a);
  } else {
    encodeFormat<F16>(a);
  }
}

void decodeCast(const DecodeArgs& a) {
  if (a.format == compress::Format::BFloat16) {
    decodeFormat<BF16>(a);
  } else {
    decodeFormat<F16>(a);
  }
}

}  // namespace detail
}  // namespace ddlcomm::gpu
