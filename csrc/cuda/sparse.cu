// The sparse decoder: top-k and random-k share the payload layout (k ascending uint32 indices,
// then k float32 values, or top-k's table and value codes), decoded by a scatter into zeros
// or, accumulating, into float32.
#include "cuda/common.cuh"
#include "cuda/launchers.h"

namespace ddlcomm::gpu::detail {
namespace {

constexpr int kThreads = 256;

// Entry j's value: float32 values, or top-k's codes into the table (valueBits > 0).
struct SparseValues {
  const float* values;  // float32[k], or the table
  const uint8_t* codes;  // null for float32 values
  uint32_t bits;
  __device__ __forceinline__ float operator()(uint64_t j) const {
    if (codes == nullptr) return values[j];
    const uint64_t bit = j * bits;
    return values[(codes[bit / 8] >> (bit % 8)) & ((1u << bits) - 1u)];
  }
};

template <typename OutT, bool kAcc>
__global__ __launch_bounds__(kThreads) void scatterKernel(const uint32_t* __restrict__ idx, SparseValues val,
                                                          uint64_t k, uint64_t numel,
                                                          typename OutT::Raw* __restrict__ out) {
  const uint64_t stride = uint64_t(gridDim.x) * blockDim.x;
  for (uint64_t j = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x; j < k; j += stride) {
    const uint32_t i = idx[j];
    if (i >= numel) continue;  // validated payloads never have this; never write out of bounds
    if (kAcc) {
      out[i] = __fadd_rn(out[i], val(j));
    } else {
      out[i] = OutT::fromFloat(val(j));
    }
  }
}

}  // namespace

void decodeSparse(const DecodeArgs& a) {
  if (!a.accumulate && a.numel > 0) {
    DDLCOMM_CUDA_CHECK(cudaMemsetAsync(a.out, 0, a.numel * elementSize(a.outType), a.cudaStream));
  }
  withOutput(a.accumulate, a.outType, [&](auto outT, auto acc) {
    using OutT = decltype(outT);
    launch(scatterKernel<OutT, decltype(acc)::value>, gridFor(a.k, kThreads * 4), kThreads, a.cudaStream,
           reinterpret_cast<const uint32_t*>(a.payload + a.layout.first),
           SparseValues{reinterpret_cast<const float*>(a.payload + a.layout.second),
                        a.valueBits ? a.payload + a.layout.codes : nullptr, a.valueBits},
           a.k, a.numel,
           static_cast<typename OutT::Raw*>(a.out));
  });
}

}  // namespace ddlcomm::gpu::detail
