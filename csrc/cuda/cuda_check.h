// Error checking for CUDA runtime calls: a failed call throws ddlcomm::Error(System) naming
// the call, the CUDA error and the source line. Plain C++ (usable outside nvcc).
#pragma once

#include <cuda_runtime_api.h>

#include "common/error.h"

namespace ddlcomm::gpu {

[[noreturn]] inline void throwCudaError(cudaError_t err, const char* what, const char* file, int line) {
  fail(ErrorKind::System, "CUDA error: ", what, " failed with ", cudaGetErrorName(err), " (",
       cudaGetErrorString(err), ") at ", file, ":", line);
}

}  // namespace ddlcomm::gpu

#define DDLCOMM_CUDA_CHECK(expr)                                                      \
  do {                                                                                \
    const cudaError_t ddlcomm_err_ = (expr);                                          \
    if (ddlcomm_err_ != cudaSuccess)                                                  \
      ::ddlcomm::gpu::throwCudaError(ddlcomm_err_, #expr, __FILE__, __LINE__);        \
  } while (0)
