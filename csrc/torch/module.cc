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
      .def("__repr__", &ProcessGroupDdlcomm::describe);
  ddlcomm::bindings::bindCompression(m);
}
