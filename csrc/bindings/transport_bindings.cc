// Transport facts and helpers: which transports this build has, and the handshake's HMAC
// (checked against Python's hmac by the tests).
#include <pybind11/stl.h>

#include "bindings/bindings.h"
#include "common/sha256.h"
#include "transport/connect.h"

namespace py = pybind11;

namespace ddlcomm::bindings {

void bindTransport(py::module_& m) {
  m.def("_transports", &transportNames, "The DDLCOMM_TRANSPORT values this build supports besides auto.");
  m.def(
      "_hmac_sha256",
      [](py::bytes key, py::bytes message) {
        Digest d = hmacSha256(std::string_view(key), {std::string_view(message)});
        return py::bytes(reinterpret_cast<const char*>(d.data()), d.size());
      },
      py::arg("key"), py::arg("message"), "HMAC-SHA256 as used by the connection handshake (for tests).");
}

}  // namespace ddlcomm::bindings
