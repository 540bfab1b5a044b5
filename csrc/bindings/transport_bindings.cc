// Transport helpers exposed for tests: the handshake's HMAC, checked against Python's hmac,
// and whether this build has the UCX transport.
#include "bindings/bindings.h"
#include "common/sha256.h"
#include "transport/connect.h"

namespace py = pybind11;

namespace ddlcomm::bindings {

void bindTransport(py::module_& m) {
  m.def(
      "_hmac_sha256",
      [](py::bytes key, py::bytes message) {
        Digest d = hmacSha256(std::string_view(key), {std::string_view(message)});
        return py::bytes(reinterpret_cast<const char*>(d.data()), d.size());
      },
      py::arg("key"), py::arg("message"), "HMAC-SHA256 as used by the connection handshake (for tests).");
  m.def("_ucx_built", &ucxBuilt, "Whether this build includes the UCX transport (DDLCOMM_TRANSPORT=ucx).");
}

}  // namespace ddlcomm::bindings
