// ddlcomm._C.compress's CUDA entry points (csrc/cuda/cuda_kernels.h) on raw device addresses
// and a cudaStream_t passed as an integer (torch.cuda.current_stream().cuda_stream). Every
// call only enqueues work on that stream. The decoders take the payload's description from
// the compressor's config and the element count instead of reading the header, which is in
// device memory: the caller validates received bytes on the host first (ddlcomm.compress),
// and the kernels never touch memory outside payload[nbytes] and out[numel] whatever the bytes.
// Without DDLCOMM_WITH_CUDA (a CPU torch) only has_cuda = False is bound.
#include <cstdint>

#include "bindings/bindings.h"

#ifdef DDLCOMM_WITH_CUDA
#include "common/dtype.h"
#include "common/error.h"
#include "compress/compress.h"
#include "cuda/cuda_kernels.h"
#endif

namespace py = pybind11;

namespace ddlcomm::bindings {

#ifdef DDLCOMM_WITH_CUDA
namespace {

using compress::Config;

template <class T>
T* at(uintptr_t address) {
  return reinterpret_cast<T*>(address);
}

cudaStream_t streamAt(uintptr_t handle) { return reinterpret_cast<cudaStream_t>(handle); }

DataType floatType(int code) {
  DDLCOMM_CHECK(code >= 0 && isValidDataType(uint8_t(code)), ErrorKind::UnsupportedType, "unknown dtype code ",
                code);
  return DataType(code);
}

}  // namespace

void bindCudaCompression(py::module_& m) {
  py::module_ c = m.attr("compress").cast<py::module_>();
  c.attr("has_cuda") = true;
  c.def("encode_workspace_bytes_cuda", [](const Config& config, int xType, size_t numel) {
    return gpu::encodeWorkspaceBytes(config, floatType(xType), numel);
  });
  c.def(
      "encode_cuda",
      [](const Config& config, int xType, uintptr_t x, uintptr_t residual, size_t numel, uint64_t stream,
         uintptr_t payload, size_t capacity, uintptr_t workspace, size_t workspaceBytes, uintptr_t cudaStream) {
        return gpu::encodeCuda(config, floatType(xType), at<const void>(x), at<float>(residual), numel, stream,
                               at<uint8_t>(payload), capacity, at<void>(workspace), workspaceBytes,
                               streamAt(cudaStream));
      },
      py::arg("config"), py::arg("x_dtype"), py::arg("x"), py::arg("residual"), py::arg("numel"), py::arg("stream"),
      py::arg("payload"), py::arg("capacity"), py::arg("workspace"), py::arg("workspace_bytes"),
      py::arg("cuda_stream"), py::call_guard<py::gil_scoped_release>());
  c.def(
      "decode_cuda",
      [](const Config& config, size_t numel, uintptr_t payload, size_t nbytes, int outType, uintptr_t out,
         bool accumulate, uintptr_t cudaStream) {
        const compress::PayloadInfo info = gpu::expectedInfo(config, numel, nbytes);
        if (accumulate) {
          gpu::decodeAccumulateCuda(info, at<const uint8_t>(payload), nbytes, at<float>(out), numel,
                                    streamAt(cudaStream));
        } else {
          gpu::decodeCuda(info, at<const uint8_t>(payload), nbytes, floatType(outType), at<void>(out), numel,
                          streamAt(cudaStream));
        }
      },
      py::arg("config"), py::arg("numel"), py::arg("payload"), py::arg("nbytes"), py::arg("out_dtype"), py::arg("out"),
      py::arg("accumulate"), py::arg("cuda_stream"), py::call_guard<py::gil_scoped_release>());
}
#else
void bindCudaCompression(py::module_& m) { m.attr("compress").attr("has_cuda") = false; }
#endif

}  // namespace ddlcomm::bindings
