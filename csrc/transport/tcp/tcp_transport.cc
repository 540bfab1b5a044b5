// Posting, progress and failure: requests are cut into stripes and queued on their
// connections; the waiting thread moves bytes on every connection, polls a while when none
// can move, then sleeps in epoll; a timeout or abort fails every request still queued.
#include "transport/tcp/tcp_transport.h"

#include <linux/tcp.h>  // struct tcp_info with the byte counters (glibc's lacks them)
#include <netinet/in.h>
#include <sched.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>

namespace ddlcomm::tcp {

TcpTransport::~TcpTransport() { abort(ErrorKind::Aborted, "transport destroyed"); }

int TcpTransport::stripeCount(const Request& r) const {
  if (r.signature.op == OpCode::PointToPoint || r.bytes < options_.stripeMinBytes) return 1;
  return options_.connectionsPerPeer;
}

TcpTransport::Stripe TcpTransport::stripeOf(Request& r, int i, int n) {
  const size_t begin = r.bytes * size_t(i) / size_t(n), end = r.bytes * size_t(i + 1) / size_t(n);
  Stripe s;
  s.request = &r;
  s.data = r.data + begin;
  s.bytes = end - begin;
  s.header = makeFrameHeader(r.signature, uint8_t(i), s.bytes);
  return s;
}

void TcpTransport::checkPeer(int peer, const char* what) const {
  DDLCOMM_CHECK(peer >= 0 && peer < size_ && peer != rank_, ErrorKind::InvalidArgument, "cannot ", what,
                " rank ", peer, " from rank ", rank_, " in a group of ", size_);
}

void TcpTransport::postSend(Request& r) {
  guarded([&] { postSendUnguarded(r); });
}

void TcpTransport::postSendUnguarded(Request& r) {
  throwIfBroken();
  checkPeer(r.peer, "send to");
  const int n = stripeCount(r);
  r.transfersLeft = n;
  r.failed = false;
  for (int i = 0; i < n; ++i) {
    Connection& c = connection(r.peer, i);
    if (c.closed) connectionFailed(c, "rank " + std::to_string(r.peer) + " closed its connection earlier");
    c.sends.push_back(stripeOf(r, i, n));
    writeSome(c);  // eager: usually the socket has room and the message leaves right away
  }
}

void TcpTransport::postRecv(Request& r) {
  guarded([&] { postRecvUnguarded(r); });
}

void TcpTransport::postRecvUnguarded(Request& r) {
  throwIfBroken();
  const int n = stripeCount(r);  // 1 for point-to-point, whichever the peer
  r.transfersLeft = n;
  r.failed = false;
  if (r.signature.op == OpCode::PointToPoint) return postP2pRecv(r);
  checkPeer(r.peer, "receive from");
  for (int i = 0; i < n; ++i) {
    Connection& c = connection(r.peer, i);
    if (c.closed) connectionFailed(c, "rank " + std::to_string(r.peer) + " closed its connection earlier");
    c.collectiveRecvs.push_back(stripeOf(r, i, n));  // its header is what the sender's must be
  }
}

bool TcpTransport::pumpAll() {
  bool moved = false;
  guarded([&] {
    for (Connection& c : connections_) {
      if (c.peer == rank_ || c.closed) continue;
      if (!c.sends.empty()) moved |= writeSome(c);
      if (c.readable) moved |= readSome(c);
    }
  });
  return moved;
}

bool TcpTransport::waitForEvents(int timeoutMs) {
  epoll_event events[64];
  int n = epoll_wait(epoll_.get(), events, 64, timeoutMs);
  if (n < 0 && errno != EINTR) {
    abort(ErrorKind::System, systemErrorText("epoll_wait", errno));
    throwIfBroken();
  }
  for (int i = 0; i < n; ++i) {
    if (events[i].data.u64 == kWakeToken) {
      uint64_t drained;
      [[maybe_unused]] ssize_t r = ::read(wakeFd_.get(), &drained, sizeof drained);
      continue;
    }
    Connection& c = connections_[events[i].data.u64];
    // Errors and hang-ups surface through recv/send, which name the cause.
    if (events[i].events & (EPOLLIN | EPOLLRDHUP | EPOLLHUP | EPOLLERR)) c.readable = true;
    if (events[i].events & (EPOLLOUT | EPOLLHUP | EPOLLERR)) c.writable = true;
  }
  return n > 0;
}

void TcpTransport::wait(Request& r, Deadline deadline) {
  Clock::time_point lastActive = Clock::now();
  while (!r.done()) {
    throwIfBroken();
    if (pumpAll()) {
      lastActive = Clock::now();
      continue;
    }
    if (r.done()) break;
    const Clock::time_point now = Clock::now();
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - now).count();
    if (left <= 0) timedOut(r);
    if (now - lastActive < spin_.duration) {  // the peer's next message is often a few us away
      waitForEvents(0);
      if (spin_.yield) sched_yield();
      continue;
    }
    if (!waitForEvents(int(std::min<long long>(left + 1, 1000))) && failureProbe_) {
      if (failureProbe_()) {
        abort(ErrorKind::PeerFailure, detail::concat("rank ", rank_, " gave up waiting in ", r.signature.describe(),
                                                     " for rank ", r.peer, ": another rank failed"));
        throwIfBroken();
      }
    }
  }
  if (r.failed) throwIfBroken();
}

void TcpTransport::poll(std::chrono::milliseconds timeout) {
  throwIfBroken();
  if (pumpAll()) return;
  if (waitForEvents(int(timeout.count()))) pumpAll();
}

TransportStats TcpTransport::stats() const {
  TransportStats s;
  s.network = "tcp";
  s.connectionsPerPeer.assign(size_t(size_), 0);
  for (const Connection& c : connections_) {
    if (c.peer == rank_ || !c.fd.valid()) continue;
    tcp_info info{};
    socklen_t length = sizeof info;
    if (getsockopt(c.fd.get(), IPPROTO_TCP, TCP_INFO, &info, &length) != 0) continue;
    if (info.tcpi_state == 1) ++s.connectionsPerPeer[size_t(c.peer)];  // TCP_ESTABLISHED (uapi names no states)
    // Kernels before 4.19 return a shorter struct: the counters are then left out (0).
    if (length >= offsetof(tcp_info, tcpi_bytes_sent) + sizeof info.tcpi_bytes_sent) s.bytesSent += info.tcpi_bytes_sent;
    if (length >= offsetof(tcp_info, tcpi_bytes_retrans) + sizeof info.tcpi_bytes_retrans) {
      s.bytesRetransmitted += info.tcpi_bytes_retrans;
    }
  }
  s.spinMicros = spin_.duration.count();
  return s;
}

void TcpTransport::wakeup() {
  uint64_t one = 1;
  [[maybe_unused]] ssize_t r = ::write(wakeFd_.get(), &one, sizeof one);
}

void TcpTransport::timedOut(const Request& r) {
  std::string progress;
  for (int i = 0; i < options_.connectionsPerPeer; ++i) {
    const Connection& c = connection(r.peer, i);
    for (const Stripe& p : c.sends) {
      if (p.request == &r) progress += detail::concat(" sent ", p.done, " of ", p.bytes, " bytes;");
    }
    for (const Stripe& p : c.collectiveRecvs) {
      if (p.request == &r) progress += detail::concat(" received ", p.done, " of ", p.bytes, " bytes;");
    }
  }
  std::string message =
      detail::concat("rank ", rank_, ": Timed out in ", r.signature.describe(), " waiting for rank ", r.peer, ":",
                     progress, " rank ", r.peer, " may be stuck, slower than the timeout, or in a different collective");
  abort(ErrorKind::Timeout, message);
  throwIfBroken();
  throw Error(ErrorKind::Timeout, message);
}

void TcpTransport::abort(ErrorKind kind, const std::string& reason) noexcept {
  if (broken_) return;
  broken_ = true;
  brokenKind_ = kind;
  brokenReason_ = failureMessage(kind, reason);
  auto failAll = [](auto& stripes) {
    for (auto& p : stripes) {
      p.request->failed = true;
      p.request->transfersLeft = 0;
    }
    stripes.clear();
  };
  for (Connection& c : connections_) {
    failAll(c.sends);
    failAll(c.collectiveRecvs);
    c.target = nullptr;
    c.unexpected = nullptr;
    if (c.fd.valid()) ::shutdown(c.fd.get(), SHUT_RDWR);
    c.fd.reset();
    c.closed = true;
  }
  for (PeerState& state : peers_) {
    failAll(state.p2pRecvs);
    state.unexpected.clear();
  }
  failAll(anyRecvs_);
}

void TcpTransport::throwIfBroken() const {
  if (broken_) throw Error(brokenKind_, brokenReason_);
}

}  // namespace ddlcomm::tcp
