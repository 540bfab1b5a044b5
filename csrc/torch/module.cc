// The Python extension module ddlcomm._C: the backend class and its constructor.
#include <pybind11/chrono.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include "bindings/bindings.h"
#include "torch/backend.h"

namespace py = pybind11;
using ddlcomm::torch_glue::ProcessGroupDdlcomm;

PYBIND11_MODULE(_C, m) {
  m.doc() = "ddlcomm native extension: the torch.distributed backend";
  py::class_<ProcessGroupDdlcomm, c10d::Backend, c10::intrusive_ptr<ProcessGroupDdlcomm>>(m, "ProcessGroupDdlcomm")
      .def(py::init([](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                       std::chrono::milliseconds timeout, std::vector<int64_t> globalRanks, std::string groupName) {
             return c10::make_intrusive<ProcessGroupDdlcomm>(store, rank, size, timeout, std::move(globalRanks),
                                                             std::move(groupName));
           }),
           py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("timeout"),
           py::arg("global_ranks") = std::vector<int64_t>{}, py::arg("group_name") = "",
           py::call_guard<py::gil_scoped_release>())
      .def("__repr__", &ProcessGroupDdlcomm::describe)
      .def("server_residual_numel", &ProcessGroupDdlcomm::serverResidualNumel, py::arg("numel"))
      .def(
          "compressed_allreduce",
          [](ProcessGroupDdlcomm& pg, at::Tensor tensor, int format, uint32_t blockSize, bool twoScales, float clip,
             double ratio, uint64_t k, bool approximate, uint64_t seed, std::optional<at::Tensor> workerResidual,
             std::optional<at::Tensor> serverResidual, bool average) {
            ddlcomm::compress::Config config;
            TORCH_CHECK_VALUE(format >= 1 && format <= 6, "unknown compression format ", format);
            config.format = ddlcomm::compress::Format(format);
            config.blockSize = blockSize;
            config.twoScales = twoScales;
            config.clip = clip;
            config.ratio = ratio;
            config.k = k;
            config.approximate = approximate;
            config.seed = seed;
            return pg.compressedAllreduce(tensor, config, workerResidual, serverResidual, average);
          },
          py::arg("tensor"), py::arg("format"), py::arg("block_size") = 256, py::arg("two_scales") = false,
          py::arg("clip") = 0.f, py::arg("ratio") = 0.01, py::arg("k") = 0, py::arg("approximate") = false,
          py::arg("seed") = 0, py::arg("worker_residual") = py::none(), py::arg("server_residual") = py::none(),
          py::arg("average") = true, py::call_guard<py::gil_scoped_release>(),
          "Compressed all-reduce with error feedback; returns a Work whose future holds [tensor].");
  ddlcomm::bindings::bindCompression(m);
}
