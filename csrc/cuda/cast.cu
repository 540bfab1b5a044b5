// float16 / bfloat16 "compression" (a plain cast, round to nearest even) with error feedback:
// residual = y - float(cast(y)). Elementwise; each thread keeps 4 independent loads in flight;
// a launch takes a table of chunks (common.cuh's Parts), a CTA a tile of one chunk at a time.
#include "cuda/common.cuh"
#include "cuda/launchers.h"

namespace ddlcomm::gpu {

// Declared in common.cuh: the header alone, for encodes of 0 elements.
__global__ void writeHeaderKernel(uint8_t* payload, HeaderWords h) { writeHeader(payload, h); }

namespace detail {
namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 4;
constexpr uint64_t kTile = uint64_t(kThreads) * kUnroll;  // elements a CTA takes at a time

uint64_t tilesOf(uint64_t numel) { return (numel + kTile - 1) / kTile; }

// Tile g of the launch: elements [t * kTile, (t + 1) * kTile) of its part's chunk (t its
// index there), thread j taking t * kTile + u * kThreads + j (u < kUnroll), so every load
// is coalesced.
template <typename XT, typename PT>
__global__ __launch_bounds__(kThreads) void castEncodeKernel(const __grid_constant__ Parts<EncodePart> p) {
  writeHeaders(p);
  for (uint64_t g = blockIdx.x; g < p.start[p.count]; g += gridDim.x) {
    const uint32_t j = partOf(p, g);
    const EncodePart& q = p.part[j];
    const auto* __restrict__ x = static_cast<const typename XT::Raw*>(q.x);
    float* __restrict__ residual = q.residual;
    auto* __restrict__ values = reinterpret_cast<uint16_t*>(q.payload + q.first);
    const uint64_t start = (g - p.start[j]) * kTile + threadIdx.x;
    float y[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint64_t i = start + uint64_t(u) * kThreads;
      y[u] = i < q.numel ? loadY<XT>(x, residual, i) : 0.f;
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint64_t i = start + uint64_t(u) * kThreads;
      if (i >= q.numel) break;
      const uint16_t h = PT::fromFloat(y[u]);
      values[i] = h;
      if (residual) residual[i] = residualAfter(y[u], PT::toFloat(h));
    }
  }
}

template <typename PT, typename OutT, bool kAcc>
__global__ __launch_bounds__(kThreads) void castDecodeKernel(const __grid_constant__ Parts<DecodePart> p) {
  for (uint64_t g = blockIdx.x; g < p.start[p.count]; g += gridDim.x) {
    const uint32_t j = partOf(p, g);
    const DecodePart& q = p.part[j];
    const auto* __restrict__ values = reinterpret_cast<const uint16_t*>(q.payload + q.first);
    auto* __restrict__ out = static_cast<typename OutT::Raw*>(q.out);
    const uint64_t start = (g - p.start[j]) * kTile + threadIdx.x;
    uint16_t v[kUnroll];
    float prev[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint64_t i = start + uint64_t(u) * kThreads;
      v[u] = i < q.numel ? values[i] : 0;
      prev[u] = kAcc && i < q.numel ? out[i] : 0.f;
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint64_t i = start + uint64_t(u) * kThreads;
      if (i >= q.numel) break;
      const float d = PT::toFloat(v[u]);
      if (kAcc) {
        out[i] = __fadd_rn(prev[u], d);
      } else {
        out[i] = OutT::fromFloat(d);
      }
    }
  }
}

// blocks::sumKernel's rule over casts: out = scale * the parts' values summed in order.
template <typename PT>
__global__ __launch_bounds__(kThreads) void castSumKernel(const __grid_constant__ Parts<DecodePart> p,
                                                          const bool fromZero, const float scale,
                                                          float* __restrict__ out) {
  const uint64_t numel = p.part[0].numel;
  for (uint64_t i = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < numel; i += uint64_t(gridDim.x) * blockDim.x) {
    float sum = fromZero ? 0.f : out[i];
    for (uint32_t j = 0; j < p.count; ++j) {
      const DecodePart& q = p.part[j];
      sum = __fadd_rn(sum, PT::toFloat(reinterpret_cast<const uint16_t*>(q.payload + q.first)[i]));
    }
    out[i] = scale == 1.f ? sum : __fmul_rn(sum, scale);
  }
}

// A chunk's work items in a launch's table: its tiles.
template <class Args>
uint64_t tiles(const Args& chunk) {
  return tilesOf(chunk.numel);
}

template <typename PT>
void encodeFormat(const EncodeArgs* a, size_t n) {
  withFloatType(a[0].xType, [&](auto xt) {
    inTables<EncodePart>(a, n, encodePartOf, tiles<EncodeArgs>, [&](const Parts<EncodePart>& p) {
      // At least one CTA: block 0 writes the headers, of empty chunks too.
      const uint64_t grid = maxOf<uint64_t>(1, gridFor(p.start[p.count], 1));
      launch(castEncodeKernel<decltype(xt), PT>, grid, kThreads, a[0].cudaStream, p);
    });
  });
}

template <typename PT>
void decodeFormat(const DecodeArgs* a, size_t n) {
  withOutput(a[0].accumulate, a[0].outType, [&](auto outT, auto acc) {
    inTables<DecodePart>(a, n, decodePartOf, tiles<DecodeArgs>, [&](const Parts<DecodePart>& p) {
      launch(castDecodeKernel<PT, decltype(outT), decltype(acc)::value>, gridFor(p.start[p.count], 1), kThreads,
             a[0].cudaStream, p);
    });
  });
}

template <typename PT>
void sumFormat(const DecodeArgs* a, size_t n, float scale, float* out) {
  sumInTables(a, n, scale, tiles<DecodeArgs>, [&](const Parts<DecodePart>& p, bool fromZero, float s) {
    launch(castSumKernel<PT>, gridFor(a[0].numel, kTile), kThreads, a[0].cudaStream, p, fromZero, s, out);
  });
}

bool isBf16(compress::Format format) { return format == compress::Format::BFloat16; }

}  // namespace

void encodeCast(const EncodeArgs* a, size_t n) {
  isBf16(a[0].config.format) ? encodeFormat<BF16>(a, n) : encodeFormat<F16>(a, n);
}

void decodeCast(const DecodeArgs* a, size_t n) {
  isBf16(a[0].format) ? decodeFormat<BF16>(a, n) : decodeFormat<F16>(a, n);
}

void sumCast(const DecodeArgs* a, size_t n, float scale, float* out) {
  isBf16(a[0].format) ? sumFormat<BF16>(a, n, scale, out) : sumFormat<F16>(a, n, scale, out);
}

}  // namespace detail
}  // namespace ddlcomm::gpu
