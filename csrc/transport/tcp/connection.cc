// One connection's state machine. Sending: header, then payload, stripe after stripe, with
// one sendmsg per attempt. Receiving: header, then payload into the matched receive or an
// unexpected-message buffer (matching.cc decides which). Nothing is read while no receive
// is posted, so TCP flow control holds a sender that runs ahead.
#include <sys/socket.h>
#include <sys/uio.h>

#include <algorithm>
#include <cerrno>

#include "transport/tcp/tcp_transport.h"

namespace ddlcomm::tcp {

bool TcpTransport::writeSome(Connection& c) {
  bool moved = false;
  while (c.writable && !c.sends.empty()) {
    Stripe& p = c.sends.front();
    iovec iov[2];
    int count = 0;
    if (p.headerDone < sizeof(FrameHeader)) {
      iov[count++] = {reinterpret_cast<char*>(&p.header) + p.headerDone, sizeof(FrameHeader) - p.headerDone};
    }
    if (p.done < p.bytes) iov[count++] = {p.data + p.done, p.bytes - p.done};
    msghdr msg{};
    msg.msg_iov = iov;
    msg.msg_iovlen = size_t(count);
    ssize_t n = ::sendmsg(c.fd.get(), &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        c.writable = false;
        break;
      }
      connectionFailed(c, systemErrorText("send", errno));
    }
    moved = true;
    size_t advance = size_t(n);
    size_t headerPart = std::min(advance, sizeof(FrameHeader) - p.headerDone);
    p.headerDone += headerPart;
    p.done += advance - headerPart;
    if (p.headerDone == sizeof(FrameHeader) && p.done == p.bytes) {
      completeStripe(p.request);
      c.sends.pop_front();
    }
  }
  return moved;
}

size_t TcpTransport::receiveSome(Connection& c, char* dst, size_t bytes) {
  while (true) {
    ssize_t n = ::recv(c.fd.get(), dst, bytes, MSG_DONTWAIT);
    if (n == 0) connectionFailed(c, "rank " + std::to_string(c.peer) + " closed the connection");
    if (n > 0) return size_t(n);
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      c.readable = false;  // until epoll reports more
      return 0;
    }
    connectionFailed(c, systemErrorText("recv", errno));
  }
}

bool TcpTransport::readSome(Connection& c) {
  bool moved = false;
  while (c.readable && !c.closed) {
    if (!c.haveHeader) {
      if (!wantsHeader(c)) break;  // nothing posted: leave the bytes in the kernel (backpressure)
      char* header = reinterpret_cast<char*>(&c.header);
      const size_t n = receiveSome(c, header + c.headerGot, sizeof(FrameHeader) - c.headerGot);
      if (n == 0) break;
      moved = true;
      c.headerGot += n;
      if (c.headerGot < sizeof(FrameHeader)) continue;
      c.signature = parseFrameHeader(c.header, c.peer);
      c.haveHeader = true;
    }
    if (!c.target && !c.unexpected && !matchIncoming(c)) break;  // collective not posted yet
    char* dst = c.target ? c.target->data : c.unexpected->data.data();
    size_t& done = c.target ? c.target->done : c.unexpected->done;
    size_t total = c.header.bytes;
    if (done < total) {
      const size_t n = receiveSome(c, dst + done, total - done);
      if (n == 0) break;
      moved = true;
      done += n;
    }
    if (done == total) finishIncoming(c);
  }
  return moved;
}

void TcpTransport::connectionFailed(Connection& c, const std::string& what) {
  c.closed = true;
  std::string context;
  if (!c.collectiveRecvs.empty()) {
    context = " while receiving " + c.collectiveRecvs.front().request->signature.describe();
  } else if (!c.sends.empty()) {
    context = " while sending " + c.sends.front().request->signature.describe();
  }
  fail(ErrorKind::PeerFailure, "rank ", rank_, " lost its connection to rank ", c.peer, context, ": ", what,
       " (did rank ", c.peer, " exit or crash?)");
}

}  // namespace ddlcomm::tcp
