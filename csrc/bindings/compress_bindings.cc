// ddlcomm._C.compress: the compressor kernels on raw addresses. The Python wrapper
// (ddlcomm/compressors.py) checks the tensors and passes data_ptr()s; these functions release the
// GIL around the kernels, which validate everything else and raise ddlcomm errors, translated
// here into ValueError / TypeError.
#include <cctype>
#include <cstdint>
#include <exception>
#include <string>

#include "bindings/bindings.h"
#include "common/dtype.h"
#include "common/error.h"
#include "compress/compress.h"

namespace py = pybind11;

namespace ddlcomm::bindings {
namespace {

using compress::Config;
using compress::Format;

template <class T>
T* at(uintptr_t address) {
  return reinterpret_cast<T*>(address);
}

DataType dataType(int code) {
  DDLCOMM_CHECK(code >= 0 && isValidDataType(uint8_t(code)), ErrorKind::UnsupportedType, "unknown dtype code ",
                code);
  return DataType(code);
}

void translateErrors(std::exception_ptr error) {
  try {
    if (error) std::rethrow_exception(error);
  } catch (const Error& e) {
    switch (reportedAs(e.kind(), /*inCollective=*/false)) {
      case Reported::Value: PyErr_SetString(PyExc_ValueError, e.what()); return;
      case Reported::Type: PyErr_SetString(PyExc_TypeError, e.what()); return;
      case Reported::Failure: PyErr_SetString(PyExc_RuntimeError, e.what()); return;
    }
  }
}

}  // namespace

void bindCompression(py::module_& m) {
  py::register_local_exception_translator(translateErrors);
  py::module_ c = m.def_submodule("compress", "Compressor kernels on raw buffers (see ddlcomm.compressors)");

  // The enum and the table of formats (compress/formats.h), from which ddlcomm.compressors
  // derives what each compressor class is.
  py::enum_<Format> formatEnum(c, "Format");
  py::list formats;
  for (const compress::FormatTraits& row : compress::kFormats) {
    std::string upper = row.name;
    for (char& ch : upper) ch = char(std::toupper(static_cast<unsigned char>(ch)));
    formatEnum.value(upper.c_str(), row.format);
    py::dict d;
    d["format"] = row.format;
    d["name"] = row.name;
    d["family"] = row.family == compress::Family::Blocks   ? "blocks"
                  : row.family == compress::Family::Sparse ? "sparse"
                                                           : "cast";
    d["value_codes"] = row.valueCodes;
    d["samples_randomly"] = row.samplesRandomly;
    formats.append(d);
  }
  c.attr("formats") = formats;

  py::class_<Config>(c, "Config")
      .def(py::init<>())
      .def_readwrite("format", &Config::format)
      .def_readwrite("block_size", &Config::blockSize)
      .def_readwrite("two_scales", &Config::twoScales)
      .def_readwrite("stochastic", &Config::stochastic)
      .def_readwrite("clip", &Config::clip)
      .def_readwrite("ratio", &Config::ratio)
      .def_readwrite("k", &Config::k)
      .def_readwrite("approximate", &Config::approximate)
      .def_readwrite("scaled", &Config::scaled)
      .def_readwrite("seed", &Config::seed)
      .def_readwrite("value_bits", &Config::valueBits);

  c.def("kept_entries", &compress::keptEntries, py::arg("config"), py::arg("numel"));
  c.def("encoded_bytes", &compress::encodedBytes, py::arg("config"), py::arg("numel"));

  py::class_<compress::TopKStats>(c, "TopKStats",
                                  "Counts of the paths approximate top-k took in the encodes given it")
      .def(py::init<>())
      .def_property_readonly("sampled", [](const compress::TopKStats& s) { return s.sampled.load(); })
      .def_property_readonly("exact_fallbacks", [](const compress::TopKStats& s) { return s.exactFallbacks.load(); });

  c.def(
      "encode",
      [](const Config& config, int xType, uintptr_t x, uintptr_t residual, size_t numel, uint64_t stream,
         uintptr_t payload, size_t capacity, compress::TopKStats* stats) {
        return compress::encode(config, dataType(xType), at<const void>(x), at<float>(residual), numel, stream,
                                at<uint8_t>(payload), capacity, stats);
      },
      py::arg("config"), py::arg("x_dtype"), py::arg("x"), py::arg("residual"), py::arg("numel"), py::arg("stream"),
      py::arg("payload"), py::arg("capacity"), py::arg("top_k_stats") = static_cast<compress::TopKStats*>(nullptr),
      py::call_guard<py::gil_scoped_release>(),
      "Encodes numel elements at address x (residual: float32 address or 0); returns the payload size. "
      "top_k_stats (a TopKStats) counts approximate top-k's paths.");

  c.def(
      "decode",
      [](uintptr_t payload, size_t bytes, int outType, uintptr_t out, size_t numel) {
        compress::decode(at<const uint8_t>(payload), bytes, dataType(outType), at<void>(out), numel);
      },
      py::arg("payload"), py::arg("nbytes"), py::arg("out_dtype"), py::arg("out"), py::arg("numel"),
      py::call_guard<py::gil_scoped_release>());

  c.def(
      "decode_accumulate",
      [](uintptr_t payload, size_t bytes, uintptr_t out, size_t numel) {
        compress::decodeAccumulate(at<const uint8_t>(payload), bytes, at<float>(out), numel);
      },
      py::arg("payload"), py::arg("nbytes"), py::arg("out"), py::arg("numel"),
      py::call_guard<py::gil_scoped_release>());

  c.def(
      "check_payload_config",
      [](uintptr_t payload, size_t bytes, const Config& config) {
        compress::checkPayloadConfig(at<const uint8_t>(payload), bytes, config);
      },
      py::arg("payload"), py::arg("nbytes"), py::arg("config"),
      "Raises ValueError unless the payload's header (its first 32 bytes suffice) has config's format, block "
      "size and flags");

  c.def(
      "inspect",
      [](uintptr_t payload, size_t bytes) {
        compress::PayloadInfo info;
        {
          py::gil_scoped_release release;
          info = compress::inspect(at<const uint8_t>(payload), bytes);
        }
        py::dict d;
        d["format"] = compress::formatName(info.format);
        d["version"] = int(compress::kPayloadVersion);
        d["two_scales"] = bool(info.flags & compress::kFlagTwoScales);
        d["stochastic"] = bool(info.flags & compress::kFlagStochastic);
        d["block_size"] = info.blockSize;
        d["numel"] = info.numel;
        d["k"] = info.k;
        d["value_bits"] = info.valueBits ? info.valueBits : 32u;
        d["nbytes"] = bytes;
        return d;
      },
      py::arg("payload"), py::arg("nbytes"));
}

}  // namespace ddlcomm::bindings
