#include "common/error.h"

#include <cstring>

namespace ddlcomm {

Reported reportedAs(ErrorKind kind, bool inCollective) {
  switch (kind) {
    case ErrorKind::InvalidArgument: return Reported::Value;
    case ErrorKind::UnsupportedType: return Reported::Type;
    case ErrorKind::Mismatch:
    case ErrorKind::Protocol: return inCollective ? Reported::Failure : Reported::Value;
    default: return Reported::Failure;
  }
}

std::string systemErrorText(const char* what, int err) {
  char buf[256];
  // GNU strerror_r may return a static string instead of filling buf.
  const char* text = strerror_r(err, buf, sizeof(buf));
  return detail::concat(what, ": ", text, " (errno ", err, ")");
}

}  // namespace ddlcomm
