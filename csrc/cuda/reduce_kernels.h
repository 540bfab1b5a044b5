// CUDA twins of csrc/reduce: elementwise reductions and the AVG epilogue on device memory,
// asynchronous and stream-ordered like cuda_kernels.h's launchers.
//
// Built and tested by the standalone CUDA project (csrc/cuda/CMakeLists.txt) only: no
// collective reduces on the GPU yet (CUDA tensors are reduced in pinned host memory), so the
// extension does not compile or link them.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

#include "common/dtype.h"

namespace ddlcomm::gpu {

// dst[i] = op(dst[i], src[i]) for i < count; same semantics as ddlcomm::reduceInto (AVG
// combines like SUM; float16/bfloat16 computed in float32 and rounded to nearest even).
void reduceCuda(ReduceOp op, DataType type, void* dst, const void* src, size_t count, cudaStream_t cudaStream);

// data[i] /= divisor (floating types), the AVG epilogue; same semantics as ddlcomm::divideBy.
void divideCuda(DataType type, void* data, size_t count, double divisor, cudaStream_t cudaStream);

}  // namespace ddlcomm::gpu
