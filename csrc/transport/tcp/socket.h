// Small RAII wrappers over BSD sockets, and the blocking helpers used while connecting.
#pragma once

#include <sys/socket.h>

#include <cstddef>
#include <string>

#include "transport/transport.h"

namespace ddlcomm::tcp {

// Owns a file descriptor; closes it on destruction.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  Fd(Fd&& other) noexcept : fd_(other.release()) {}
  Fd& operator=(Fd&& other) noexcept;
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() { reset(); }

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  int release();
  void reset();

 private:
  int fd_ = -1;
};

struct Address {
  sockaddr_storage storage{};
  socklen_t length = 0;

  static Address parse(const std::string& host, int port);  // numeric host or name
  std::string host() const;
  int port() const;
  std::string toString() const;  // "host:port", or "[v6]:port"
  static Address fromString(const std::string& text);
};

// The address this rank listens on: DDLCOMM_SOCKET_ADDR, else the first address of the
// interface DDLCOMM_SOCKET_IFNAME, else the local address of the route to MASTER_ADDR,
// else 127.0.0.1.
std::string chooseLocalHost();

Fd listenOn(const std::string& host, Address* bound);
// Connects (retrying refused connections until `deadline`), returns a blocking socket.
Fd connectTo(const Address& address, Deadline deadline);

// Blocking exact I/O with a deadline, for the handshake before the event loop starts.
void writeAll(int fd, const void* data, size_t bytes, Deadline deadline);
void readAll(int fd, void* data, size_t bytes, Deadline deadline);

void setNonBlocking(int fd, bool on);
// TCP_NODELAY, keepalive, and optional fixed buffer sizes (0 keeps kernel autotuning).
void tuneDataSocket(int fd, int bufferBytes);

}  // namespace ddlcomm::tcp
