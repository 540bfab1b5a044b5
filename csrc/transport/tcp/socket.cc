#include "transport/tcp/socket.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <thread>

#include "common/env.h"
#include "common/error.h"

namespace ddlcomm::tcp {
namespace {

int millisUntil(Deadline deadline) {
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return left <= 0 ? 0 : int(std::min<long long>(left, 1000 * 1000));
}

// Waits for `events` on fd; false on deadline.
bool waitFor(int fd, short events, Deadline deadline) {
  while (true) {
    pollfd p{fd, events, 0};
    int rc = ::poll(&p, 1, millisUntil(deadline));
    if (rc > 0) return true;
    if (rc == 0) return false;
    if (errno != EINTR) fail(ErrorKind::System, systemErrorText("poll", errno));
  }
}

std::string interfaceAddress(const std::string& ifname) {
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) fail(ErrorKind::System, systemErrorText("getifaddrs", errno));
  std::string found, v6;
  for (ifaddrs* it = list; it; it = it->ifa_next) {
    if (!it->ifa_addr || ifname != it->ifa_name) continue;
    char buf[INET6_ADDRSTRLEN] = {};
    if (it->ifa_addr->sa_family == AF_INET) {
      inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(it->ifa_addr)->sin_addr, buf, sizeof buf);
      found = buf;
      break;
    }
    if (it->ifa_addr->sa_family == AF_INET6 && v6.empty()) {
      auto* a6 = reinterpret_cast<sockaddr_in6*>(it->ifa_addr);
      if (!IN6_IS_ADDR_LINKLOCAL(&a6->sin6_addr)) {
        inet_ntop(AF_INET6, &a6->sin6_addr, buf, sizeof buf);
        v6 = buf;
      }
    }
  }
  freeifaddrs(list);
  if (found.empty()) found = v6;
  DDLCOMM_CHECK(!found.empty(), ErrorKind::InvalidArgument, "DDLCOMM_SOCKET_IFNAME=", ifname,
                ": no such interface with an IP address on this host");
  return found;
}

// The local address the kernel would use to reach `host` (no packet is sent: connect() on
// a UDP socket only picks a route).
std::string routeSourceAddress(const std::string& host) {
  Address remote;
  try {
    remote = Address::parse(host, 9);
  } catch (const Error&) {
    return "";
  }
  Fd fd(::socket(remote.storage.ss_family, SOCK_DGRAM | SOCK_CLOEXEC, 0));
  if (!fd.valid() || ::connect(fd.get(), reinterpret_cast<sockaddr*>(&remote.storage), remote.length) != 0) {
    return "";
  }
  Address local;
  local.length = sizeof local.storage;
  if (getsockname(fd.get(), reinterpret_cast<sockaddr*>(&local.storage), &local.length) != 0) return "";
  return local.host();
}

}  // namespace

Fd& Fd::operator=(Fd&& other) noexcept {
  if (this != &other) {
    reset();
    fd_ = other.release();
  }
  return *this;
}

int Fd::release() {
  int fd = fd_;
  fd_ = -1;
  return fd;
}

void Fd::reset() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

Address Address::parse(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* result = nullptr;
  std::string service = std::to_string(port);
  int rc = getaddrinfo(host.c_str(), service.c_str(), &hints, &result);
  DDLCOMM_CHECK(rc == 0 && result, ErrorKind::InvalidArgument, "cannot resolve host '", host, "': ", gai_strerror(rc));
  Address a;
  std::memcpy(&a.storage, result->ai_addr, result->ai_addrlen);
  a.length = result->ai_addrlen;
  freeaddrinfo(result);
  return a;
}

std::string Address::host() const {
  char buf[INET6_ADDRSTRLEN] = {};
  if (storage.ss_family == AF_INET) {
    inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(&storage)->sin_addr, buf, sizeof buf);
  } else {
    inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6*>(&storage)->sin6_addr, buf, sizeof buf);
  }
  return buf;
}

int Address::port() const {
  return storage.ss_family == AF_INET ? ntohs(reinterpret_cast<const sockaddr_in*>(&storage)->sin_port)
                                      : ntohs(reinterpret_cast<const sockaddr_in6*>(&storage)->sin6_port);
}

std::string Address::toString() const {
  return storage.ss_family == AF_INET6 ? "[" + host() + "]:" + std::to_string(port())
                                       : host() + ":" + std::to_string(port());
}

Address Address::fromString(const std::string& text) {
  // Written by a peer through the store: a port of 1 to 5 digits (atoi would overflow on more),
  // and a v6 host in brackets.
  auto colon = text.rfind(':');
  const std::string port = colon == std::string::npos ? "" : text.substr(colon + 1);
  const bool digits = !port.empty() && port.size() <= 5 && port.find_first_not_of("0123456789") == std::string::npos;
  const int number = digits ? std::stoi(port) : 0;
  DDLCOMM_CHECK(number >= 1 && number <= 65535, ErrorKind::Protocol, "malformed address '", text, "'");
  std::string host = text.substr(0, colon);
  if (!host.empty() && host.front() == '[') {
    DDLCOMM_CHECK(host.size() >= 2 && host.back() == ']', ErrorKind::Protocol, "malformed address '", text, "'");
    host = host.substr(1, host.size() - 2);
  }
  return parse(host, number);
}

std::string chooseLocalHost() {
  if (const char* addr = envString("DDLCOMM_SOCKET_ADDR")) return addr;
  if (const char* ifname = envString("DDLCOMM_SOCKET_IFNAME")) return interfaceAddress(ifname);
  if (const char* master = envString("MASTER_ADDR")) {
    std::string local = routeSourceAddress(master);
    if (!local.empty()) return local;
  }
  return "127.0.0.1";
}

Fd listenOn(const std::string& host, Address* bound) {
  Address want = Address::parse(host, 0);
  Fd fd(::socket(want.storage.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0));
  DDLCOMM_CHECK(fd.valid(), ErrorKind::System, systemErrorText("socket", errno));
  if (::bind(fd.get(), reinterpret_cast<sockaddr*>(&want.storage), want.length) != 0) {
    fail(ErrorKind::System, systemErrorText(("bind " + host).c_str(), errno),
         " (set DDLCOMM_SOCKET_IFNAME or DDLCOMM_SOCKET_ADDR to an address of this host)");
  }
  DDLCOMM_CHECK(::listen(fd.get(), SOMAXCONN) == 0, ErrorKind::System, systemErrorText("listen", errno));
  bound->length = sizeof bound->storage;
  getsockname(fd.get(), reinterpret_cast<sockaddr*>(&bound->storage), &bound->length);
  return fd;
}

Fd connectTo(const Address& address, Deadline deadline) {
  int lastErr = 0;
  auto backoff = std::chrono::milliseconds(5);
  while (Clock::now() < deadline) {
    Fd fd(::socket(address.storage.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
    DDLCOMM_CHECK(fd.valid(), ErrorKind::System, systemErrorText("socket", errno));
    int rc = ::connect(fd.get(), reinterpret_cast<const sockaddr*>(&address.storage), address.length);
    if (rc != 0 && errno == EINPROGRESS) {
      if (waitFor(fd.get(), POLLOUT, deadline)) {
        socklen_t len = sizeof lastErr;
        getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &lastErr, &len);
        rc = lastErr == 0 ? 0 : -1;
      } else {
        lastErr = ETIMEDOUT;
      }
    } else if (rc != 0) {
      lastErr = errno;
    }
    if (rc == 0) {
      setNonBlocking(fd.get(), false);
      return fd;
    }
    // A refused connection usually means the peer has not called listen() yet.
    std::this_thread::sleep_for(backoff);
    backoff = std::min(backoff * 2, std::chrono::milliseconds(200));
  }
  fail(ErrorKind::Timeout, "could not connect to ", address.toString(), ": ",
       systemErrorText("connect", lastErr ? lastErr : ETIMEDOUT));
}

void writeAll(int fd, const void* data, size_t bytes, Deadline deadline) {
  auto* p = static_cast<const char*>(data);
  while (bytes > 0) {
    if (!waitFor(fd, POLLOUT, deadline)) fail(ErrorKind::Timeout, "timed out sending handshake");
    ssize_t n = ::send(fd, p, bytes, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n < 0) {
      if (errno == EINTR || errno == EAGAIN) continue;
      fail(ErrorKind::PeerFailure, systemErrorText("send", errno));
    }
    p += n;
    bytes -= size_t(n);
  }
}

void readAll(int fd, void* data, size_t bytes, Deadline deadline) {
  auto* p = static_cast<char*>(data);
  while (bytes > 0) {
    if (!waitFor(fd, POLLIN, deadline)) fail(ErrorKind::Timeout, "timed out reading handshake");
    ssize_t n = ::recv(fd, p, bytes, MSG_DONTWAIT);
    if (n == 0) fail(ErrorKind::PeerFailure, "connection closed during handshake");
    if (n < 0) {
      if (errno == EINTR || errno == EAGAIN) continue;
      fail(ErrorKind::PeerFailure, systemErrorText("recv", errno));
    }
    p += n;
    bytes -= size_t(n);
  }
}

void setNonBlocking(int fd, bool on) {
  int flags = fcntl(fd, F_GETFL, 0);
  fcntl(fd, F_SETFL, on ? (flags | O_NONBLOCK) : (flags & ~O_NONBLOCK));
}

void tuneDataSocket(int fd, int bufferBytes) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof one);
  if (bufferBytes > 0) {
    setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &bufferBytes, sizeof bufferBytes);
    setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &bufferBytes, sizeof bufferBytes);
  }
}

}  // namespace ddlcomm::tcp
