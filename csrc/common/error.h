// Errors raised by the torch-free layers. reportedAs() says which exception a user expects
// for each kind; the torch glue and the kernel bindings raise it in their own types.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace ddlcomm {

enum class ErrorKind {
  InvalidArgument,  // the caller passed something wrong (ValueError)
  UnsupportedType,  // dtype/op combination that makes no sense (TypeError)
  Timeout,          // a deadline passed while waiting for peers
  PeerFailure,      // a peer closed, reset or aborted the connection
  Mismatch,         // ranks called different collectives, sizes or dtypes
  Protocol,         // malformed bytes on the wire or in a payload
  Aborted,          // the communicator was aborted earlier; it stays unusable
  System,           // a syscall failed locally
};

class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, std::string message)
      : std::runtime_error(std::move(message)), kind_(kind) {}
  ErrorKind kind() const { return kind_; }

 private:
  ErrorKind kind_;
};

namespace detail {
template <typename... Args>
std::string concat(const Args&... args) {
  std::ostringstream out;
  (out << ... << args);
  return out.str();
}
}  // namespace detail

template <typename... Args>
[[noreturn]] void fail(ErrorKind kind, const Args&... args) {
  throw Error(kind, detail::concat(args...));
}

// The exception class a user expects for an Error: ValueError, TypeError, or a failure
// (torch's DistBackendError from a collective, RuntimeError from a kernel call).
enum class Reported { Value, Type, Failure };
// `inCollective`: a malformed payload or a mismatch met while exchanging with peers is the
// group's failure; in a payload the caller hands to a kernel, it is bad input.
Reported reportedAs(ErrorKind kind, bool inCollective);

// errno text for a failed syscall, e.g. "connect: Connection refused".
std::string systemErrorText(const char* what, int err);

}  // namespace ddlcomm

#define DDLCOMM_CHECK(cond, kind, ...)          \
  do {                                          \
    if (!(cond)) ::ddlcomm::fail(kind, __VA_ARGS__); \
  } while (0)
