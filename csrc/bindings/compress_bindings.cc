#include "bindings/bindings.h"

namespace ddlcomm::bindings {

void bindCompression(pybind11::module_&) {}

}  // namespace ddlcomm::bindings
