// Device helpers shared by the CUDA kernels: element conversions that match the CPU's bits,
// warp reductions in the contract's order, the launch wrapper. Included by .cu files only.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "common/dtype.h"
#include "compress/counter_random.h"
#include "cuda/cuda_check.h"
#include "cuda/launchers.h"

namespace ddlcomm::gpu {

constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kWarpSize = 32;

template <typename T>
__host__ __device__ __forceinline__ T minOf(T a, T b) { return b < a ? b : a; }
template <typename T>
__host__ __device__ __forceinline__ T maxOf(T a, T b) { return a < b ? b : a; }

__device__ __forceinline__ bool isFiniteF(float v) { return (__float_as_uint(v) & 0x7f800000u) != 0x7f800000u; }

// ---- 16-bit floats, bit-identical to common/half.h ----------------------------------------
// The hardware conversions round to nearest even like the CPU; only NaNs differ (the GPU makes
// a canonical NaN), so NaNs are fixed up to half.h's bits on a rarely taken branch: a half NaN
// widens with its payload kept, a float NaN narrows to the quiet NaN 0x7e00 with its sign.
__device__ __forceinline__ float halfBitsToFloat(uint16_t h) {
  float f = __half2float(__ushort_as_half(h));
  if ((h & 0x7fffu) > 0x7c00u)
    f = __uint_as_float((uint32_t(h & 0x8000u) << 16) | 0x7f800000u | (uint32_t(h & 0x3ffu) << 13));
  return f;
}

__device__ __forceinline__ uint16_t floatToHalfBits(float f) {
  uint16_t h = __half_as_ushort(__float2half_rn(f));
  const uint32_t u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) h = uint16_t(((u >> 16) & 0x8000u) | 0x7e00u);
  return h;
}

// Same integer arithmetic as common/half.h (which device code cannot include: _Float16).
__device__ __forceinline__ float bf16BitsToFloat(uint16_t b) { return __uint_as_float(uint32_t(b) << 16); }

__device__ __forceinline__ uint16_t floatToBf16Bits(float f) {
  uint32_t u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

// Element types an encoder reads (x) or a decoder writes (out), as raw storage + conversions.
struct F32 {
  using Raw = float;
  static __device__ __forceinline__ float toFloat(float v) { return v; }
  static __device__ __forceinline__ float fromFloat(float v) { return v; }
};
struct F16 {
  using Raw = uint16_t;
  static __device__ __forceinline__ float toFloat(uint16_t v) { return halfBitsToFloat(v); }
  static __device__ __forceinline__ uint16_t fromFloat(float v) { return floatToHalfBits(v); }
};
struct BF16 {
  using Raw = uint16_t;
  static __device__ __forceinline__ float toFloat(uint16_t v) { return bf16BitsToFloat(v); }
  static __device__ __forceinline__ uint16_t fromFloat(float v) { return floatToBf16Bits(v); }
};

// The one float-dtype switch: fn(F32{}), fn(F16{}) or fn(BF16{}) for `type` (the callers have
// rejected other dtypes). Host and device: fn's own execution space decides.
#if defined(__CUDACC__)
#pragma nv_exec_check_disable
#endif
template <typename Fn>
__host__ __device__ __forceinline__ decltype(auto) withFloatType(DataType type, Fn&& fn) {
  switch (type) {
    case DataType::Float16: return fn(F16{});
    case DataType::BFloat16: return fn(BF16{});
    default: return fn(F32{});
  }
}

// A decoder's output: fn(F32{}, std::true_type{}) to add into float32, else
// fn(OutT{}, std::false_type{}) to assign in outType.
template <typename Fn>
void withOutput(bool accumulate, DataType outType, Fn&& fn) {
  if (accumulate) return fn(F32{}, std::true_type{});
  withFloatType(outType, [&](auto outT) { fn(outT, std::false_type{}); });
}

// y = x + residual, one float32 add (no contraction possible).
template <typename XT>
__device__ __forceinline__ float loadY(const typename XT::Raw* __restrict__ x, const float* __restrict__ residual,
                                       uint64_t i) {
  const float xv = XT::toFloat(x[i]);
  return residual ? __fadd_rn(xv, residual[i]) : xv;
}

// Error feedback: residual = y - decoded, or 0 where that is not finite (compress.h's rule:
// a non-finite input or decoded value never stays in the residual).
__device__ __forceinline__ float residualAfter(float y, float decoded) {
  const float r = __fsub_rn(y, decoded);
  return isFiniteF(r) ? r : 0.0f;
}

// Top-k order: |v| as its float32 bits, which orders like the magnitude, NaN above +inf (by
// payload, as on the CPU). Larger key first; equal keys are taken in index order.
constexpr uint32_t kInfKey = 0x7f800000u;
__device__ __forceinline__ uint32_t magnitudeKey(float v) { return __float_as_uint(v) & 0x7fffffffu; }

// ---- warp collectives ---------------------------------------------------------------------
// The contract's lane combination: lane[j] += lane[j+16], +8, +4, +2, +1; result on all lanes.
__device__ __forceinline__ float warpSumContract(float v) {
#pragma unroll
  for (int d = 16; d >= 1; d >>= 1) v = __fadd_rn(v, __shfl_down_sync(kFullMask, v, d));
  return __shfl_sync(kFullMask, v, 0);
}

__device__ __forceinline__ uint32_t warpSumU32(uint32_t v) {
#pragma unroll
  for (int d = 16; d >= 1; d >>= 1) v += __shfl_xor_sync(kFullMask, v, d);
  return v;
}

__device__ __forceinline__ uint32_t warpMaxU32(uint32_t v) {
#pragma unroll
  for (int d = 16; d >= 1; d >>= 1) v = maxOf(v, __shfl_xor_sync(kFullMask, v, d));
  return v;
}

// Inclusive prefix sum over the lanes of a warp.
template <typename T>
__device__ __forceinline__ T warpInclusiveScan(T v, int lane) {
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const T o = __shfl_up_sync(kFullMask, v, d);
    if (lane >= d) v += o;
  }
  return v;
}

__device__ __forceinline__ uint32_t laneMaskLt(int lane) { return (1u << lane) - 1u; }

// Exclusive prefix sum over a block of kThreads threads (all must call it); `total` gets the
// block's sum. Ends with a barrier, so it can be called again right away.
template <int kThreads>
__device__ __forceinline__ uint64_t blockExclusiveScan(uint64_t v, uint64_t& total) {
  __shared__ uint64_t warpSums[kThreads / kWarpSize];
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const uint64_t inc = warpInclusiveScan(v, lane);
  if (lane == kWarpSize - 1) warpSums[warp] = inc;
  __syncthreads();
  if (warp == 0) {
    const uint64_t w = lane < kThreads / kWarpSize ? warpSums[lane] : 0;
    const uint64_t scanned = warpInclusiveScan(w, lane);
    if (lane < kThreads / kWarpSize) warpSums[lane] = scanned;
  }
  __syncthreads();
  const uint64_t result = inc - v + (warp > 0 ? warpSums[warp - 1] : 0);
  total = warpSums[kThreads / kWarpSize - 1];
  __syncthreads();
  return result;
}

// Block 0 writes the 32 header bytes (payload is 4-byte aligned; checked on the host). The
// word is selected with constant indices: a run-time index into a kernel parameter would
// copy the parameter to local memory.
__device__ __forceinline__ void writeHeader(uint8_t* payload, const HeaderWords& h) {
  if (blockIdx.x != 0 || threadIdx.x >= 8) return;
  uint32_t v = h.w[0];
#pragma unroll
  for (unsigned j = 1; j < 8; ++j)
    if (threadIdx.x == j) v = h.w[j];
  reinterpret_cast<uint32_t*>(payload)[threadIdx.x] = v;
}

__global__ void writeHeaderKernel(uint8_t* payload, HeaderWords h);  // in cast.cu

// ---- several chunks a launch -----------------------------------------------------------------
// The block formats' and the casts' kernels take a table of up to kMaxParts chunks (launchers.h),
// each with its own payload: part j holds the launch's work items (scale blocks, or tiles of
// elements) [start[j], start[j + 1]). The table is a __grid_constant__ parameter, so that a
// run-time index reads it in place instead of copying it to local memory.
struct EncodePart {
  const void* x;     // numel elements of the encode's xType
  float* residual;   // numel, or null
  uint64_t numel;
  uint8_t* payload;  // its header, then compress::PayloadLayout's sections at first and second
  uint64_t first, second;
  HeaderWords header;
  uint64_t stream;  // randomness stream
};

struct DecodePart {
  const uint8_t* payload;
  uint64_t first, second;
  uint64_t numel;
  void* out;  // numel elements of the decode's output type
};

template <class Part>
struct Parts {
  uint32_t count;
  uint64_t start[detail::kMaxParts + 1];
  Part part[detail::kMaxParts];
};

// The part holding work item g of the launch (g < start[count]).
template <class Part>
__device__ __forceinline__ uint32_t partOf(const Parts<Part>& p, uint64_t g) {
  uint32_t j = 0;
  while (j + 1 < p.count && p.start[j + 1] <= g) ++j;
  return j;
}

// Block 0 writes every part's 32 header bytes, a word a thread (blockDim.x >= 8 * kMaxParts).
__device__ __forceinline__ void writeHeaders(const Parts<EncodePart>& p) {
  if (blockIdx.x != 0 || threadIdx.x >= 8 * p.count) return;
  const EncodePart& q = p.part[threadIdx.x / 8];
  reinterpret_cast<uint32_t*>(q.payload)[threadIdx.x % 8] = q.header.w[threadIdx.x % 8];
}

// Launches of up to kMaxParts parts each over args[0, n): makePart(args[i]) is part i's entry,
// units(args[i]) its work items; launchParts(table) launches one table.
template <class Part, class Args, class MakePart, class Units, class LaunchParts>
void inTables(const Args* args, size_t n, MakePart&& makePart, Units&& units, LaunchParts&& launchParts) {
  for (size_t i0 = 0; i0 < n; i0 += detail::kMaxParts) {
    Parts<Part> p{};
    p.count = uint32_t(minOf<size_t>(detail::kMaxParts, n - i0));
    for (uint32_t j = 0; j < p.count; ++j) {
      p.part[j] = makePart(args[i0 + j]);
      p.start[j + 1] = p.start[j] + units(args[i0 + j]);
    }
    launchParts(p);
  }
}

inline EncodePart encodePartOf(const detail::EncodeArgs& a) {
  return {a.x, a.residual, a.numel, a.payload, a.layout.first, a.layout.second, a.header, a.stream};
}

inline DecodePart decodePartOf(const detail::DecodeArgs& a) {
  return {a.payload, a.layout.first, a.layout.second, a.numel, a.out};
}

// A sum's tables: launchSum(table, fromZero, scale) for each, the first adding to 0, the last
// applying the scale (one float32 multiply, after every add).
template <class Units, class LaunchSum>
void sumInTables(const detail::DecodeArgs* args, size_t n, float scale, Units&& units, LaunchSum&& launchSum) {
  size_t done = 0;
  inTables<DecodePart>(args, n, decodePartOf, units, [&](const Parts<DecodePart>& p) {
    launchSum(p, done == 0, done + p.count == n ? scale : 1.f);
    done += p.count;
  });
}

// ---- launching -----------------------------------------------------------------------------
// Blocks for `work` items at `perBlock` items each, capped (kernels loop grid-stride), so
// grids stay within gridDim.x limits for any size; 0 for no work (nothing is launched).
inline uint64_t gridFor(uint64_t work, uint64_t perBlock, uint64_t cap = 1u << 20) {
  const uint64_t g = (work + perBlock - 1) / perBlock;
  return g < cap ? g : cap;
}

// Launches kernel<<<grid, block, 0, stream>>>(args...) and checks the launch; a grid of 0 is
// a no-op. Without nvcc (tests/cuda/emu, the CPU emulator used to test kernel logic on
// machines without a GPU) the same call runs the kernel on the host.
template <typename... KArgs, typename... Args>
void launch(void (*kernel)(KArgs...), uint64_t grid, unsigned block, cudaStream_t stream, Args... args) {
  if (grid == 0) return;
#if defined(__CUDACC__)
  kernel<<<dim3(unsigned(grid)), dim3(block), 0, stream>>>(static_cast<KArgs>(args)...);
#else
  emuLaunch(kernel, grid, block, stream, static_cast<KArgs>(args)...);
#endif
  DDLCOMM_CUDA_CHECK(cudaGetLastError());
}

}  // namespace ddlcomm::gpu
