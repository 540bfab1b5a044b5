// Python bindings of the torch-free layers. They take raw addresses (tensor.data_ptr())
// from the Python wrappers, so these files need no torch headers and compile quickly.
#pragma once

#include <pybind11/pybind11.h>

namespace ddlcomm::bindings {

// Adds the compressor kernels to `m` (csrc/bindings/compress_bindings.cc).
void bindCompression(pybind11::module_& m);
// Adds the CUDA kernels to m.compress when built with them, else has_cuda = False
// (csrc/bindings/cuda_bindings.cc).
void bindCudaCompression(pybind11::module_& m);
// Adds _transports and _hmac_sha256 (csrc/bindings/transport_bindings.cc).
void bindTransport(pybind11::module_& m);

}  // namespace ddlcomm::bindings
