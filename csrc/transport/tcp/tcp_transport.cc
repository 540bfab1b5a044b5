#include "transport/tcp/tcp_transport.h"

#include <linux/tcp.h>  // struct tcp_info with the byte counters (glibc's lacks them)
#include <netinet/in.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/eventfd.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>

#include "common/env.h"
#include "transport/tcp/handshake.h"

namespace ddlcomm::tcp {
namespace {

constexpr uint64_t kWakeToken = ~uint64_t(0);

std::string humanBytes(size_t bytes) { return detail::concat(bytes, " bytes"); }

}  // namespace

TcpOptions TcpOptions::fromEnvironment() {
  constexpr int64_t kIntMax = std::numeric_limits<int>::max();
  TcpOptions o;
  if (const char* host = envString("DDLCOMM_SOCKET_ADDR")) o.host = host;
  o.connectionsPerPeer = int(envInteger("DDLCOMM_SOCKETS_PER_PEER", o.connectionsPerPeer, 1, 16));
  o.stripeMinBytes = size_t(envInteger("DDLCOMM_STRIPE_MIN_BYTES", int64_t(o.stripeMinBytes), 0));
  o.socketBufferBytes = int(envInteger("DDLCOMM_SOCKET_BUFFER_BYTES", o.socketBufferBytes, 0, kIntMax));
  // At least 1 ms: with 0 every connection would be dropped before its first byte.
  o.handshakeTimeout = std::chrono::milliseconds(
      envInteger("DDLCOMM_HANDSHAKE_TIMEOUT_MS", o.handshakeTimeout.count(), 1, kIntMax));
  return o;
}

TcpTransport::TcpTransport(int rank, int size, const TcpOptions& options)
    : rank_(rank), size_(size), options_(options) {
  connections_.resize(size_t(size) * options.connectionsPerPeer);
  peers_.resize(size_t(size));
  for (int p = 0; p < size; ++p) {
    for (int i = 0; i < options.connectionsPerPeer; ++i) {
      connection(p, i).peer = p;
      connection(p, i).index = i;
    }
  }
}

TcpTransport::~TcpTransport() { abort(ErrorKind::Aborted, "transport destroyed"); }

std::unique_ptr<TcpTransport> TcpTransport::connect(int rank, int size, KeyValueStore& store,
                                                    const TcpOptions& options) {
  DDLCOMM_CHECK(size >= 1 && rank >= 0 && rank < size, ErrorKind::InvalidArgument, "invalid rank ", rank,
                " for world size ", size);
  std::unique_ptr<TcpTransport> t(new TcpTransport(rank, size, options));
  t->establish(store);
  return t;
}

void TcpTransport::establish(KeyValueStore& store) {
  epoll_ = Fd(epoll_create1(EPOLL_CLOEXEC));
  wakeFd_ = Fd(eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
  DDLCOMM_CHECK(epoll_.valid() && wakeFd_.valid(), ErrorKind::System, systemErrorText("epoll/eventfd", errno));
  epoll_event wakeEvent{};
  wakeEvent.events = EPOLLIN;
  wakeEvent.data.u64 = kWakeToken;
  epoll_ctl(epoll_.get(), EPOLL_CTL_ADD, wakeFd_.get(), &wakeEvent);
  if (size_ == 1) return;

  const int k = options_.connectionsPerPeer;
  const Deadline deadline = Clock::now() + options_.connectTimeout;
  const std::string key = groupKey(store, rank_);
  Address bound;
  Fd listener = listenOn(options_.host.empty() ? chooseLocalHost() : options_.host, &bound);
  localAddress_ = bound.toString();
  store.set("ddlcomm/addr/" + std::to_string(rank_), localAddress_);

  const Hello mine = makeHello(rank_, size_, k);
  // Only authenticated peers get here, so a disagreement is a misconfigured job: fatal.
  auto checkHello = [&](const Hello& h, const std::string& from) {
    DDLCOMM_CHECK(h.size == size_ && h.connectionsPerPeer == k && h.rank >= 0 && h.rank < size_ &&
                      h.index >= 0 && h.index < k,
                  ErrorKind::Mismatch, "peer ", from, " has world size ", h.size, " and ", h.connectionsPerPeer,
                  " sockets per peer; this rank has ", size_, " and ", k, " (DDLCOMM_SOCKETS_PER_PEER must match)");
  };

  // Lower ranks accept, higher ranks connect: rank 0 only accepts, so no cycle can form.
  for (int peer = 0; peer < rank_; ++peer) {
    Address address = Address::fromString(store.get("ddlcomm/addr/" + std::to_string(peer)));
    const std::string name = "rank " + std::to_string(peer) + " at " + address.toString();
    for (int i = 0; i < k; ++i) {
      Hello hello = mine, reply{};
      hello.index = i;
      Fd fd = connectAuthenticated(address, name, key, hello, deadline, &reply);
      checkHello(reply, name);
      DDLCOMM_CHECK(reply.rank == peer, ErrorKind::Mismatch, "address ", address.toString(), " of rank ", peer,
                    " answered as rank ", reply.rank, " (stale address in the store?)");
      connection(peer, i).fd = std::move(fd);
    }
  }
  Acceptor acceptor(std::move(listener), key, mine, options_.handshakeTimeout);
  int expected = (size_ - 1 - rank_) * k;
  while (expected > 0) {
    Hello hello{};
    Fd fd;
    try {
      fd = acceptor.next(deadline, &hello);
    } catch (const Error& e) {
      if (e.kind() != ErrorKind::Timeout) throw;
      std::string missing;
      for (int peer = rank_ + 1; peer < size_; ++peer) {
        bool complete = true;
        for (int i = 0; i < k; ++i) complete = complete && connection(peer, i).fd.valid();
        if (!complete) missing += (missing.empty() ? "" : ", ") + std::to_string(peer);
      }
      fail(ErrorKind::Timeout, e.what(), " (still missing rank ", missing, ")");
    }
    const std::string name = "rank " + std::to_string(hello.rank);
    checkHello(hello, name);
    DDLCOMM_CHECK(hello.rank > rank_, ErrorKind::Mismatch, name, " connected to rank ", rank_,
                  " but only higher ranks connect (do two processes have the same RANK?)");
    Connection& c = connection(hello.rank, hello.index);
    if (!c.fd.valid()) --expected;  // else a retry after a lost reply replaces the earlier socket
    c.fd = std::move(fd);
  }

  for (size_t slot = 0; slot < connections_.size(); ++slot) {
    Connection& c = connections_[slot];
    if (c.peer == rank_) continue;
    setNonBlocking(c.fd.get(), true);
    tuneDataSocket(c.fd.get(), options_.socketBufferBytes);
    epoll_event ev{};
    ev.events = EPOLLIN | EPOLLOUT | EPOLLRDHUP | EPOLLET;
    ev.data.u64 = slot;
    DDLCOMM_CHECK(epoll_ctl(epoll_.get(), EPOLL_CTL_ADD, c.fd.get(), &ev) == 0, ErrorKind::System,
                  systemErrorText("epoll_ctl", errno));
    c.readable = true;  // data may have arrived before registration
  }
}

int TcpTransport::pieceCount(const Request& r) const {
  if (r.signature.op == OpCode::PointToPoint || r.bytes < options_.stripeMinBytes) return 1;
  return options_.connectionsPerPeer;
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
  const int n = pieceCount(r);
  r.piecesLeft = n;
  r.failed = false;
  for (int i = 0; i < n; ++i) {
    Connection& c = connection(r.peer, i);
    if (c.closed) connectionFailed(c, "rank " + std::to_string(r.peer) + " closed its connection earlier");
    size_t begin = r.bytes * size_t(i) / size_t(n), end = r.bytes * size_t(i + 1) / size_t(n);
    Piece p;
    p.request = &r;
    p.data = r.data + begin;
    p.bytes = end - begin;
    p.header = makeFrameHeader(r.signature, uint8_t(i), p.bytes);
    c.sends.push_back(p);
    writeSome(c);  // eager: usually the socket has room and the message leaves right away
  }
}

void TcpTransport::postRecv(Request& r) {
  guarded([&] { postRecvUnguarded(r); });
}

void TcpTransport::postRecvUnguarded(Request& r) {
  throwIfBroken();
  const int n = pieceCount(r);  // 1 for point-to-point, whichever the peer
  r.piecesLeft = n;
  r.failed = false;
  if (r.signature.op == OpCode::PointToPoint && r.peer == kAnySource) {
    Piece p;
    p.request = &r;
    p.data = r.data;
    p.bytes = r.bytes;
    anyRecvs_.push_back(p);
    matchAnySource();
    return;
  }
  checkPeer(r.peer, "receive from");
  if (r.signature.op == OpCode::PointToPoint) {
    PeerState& state = peers_[size_t(r.peer)];
    for (auto it = state.unexpected.begin(); it != state.unexpected.end(); ++it) {
      if (it->signature.seq != r.signature.seq) continue;
      Piece p;
      p.request = &r;
      p.data = r.data;
      p.bytes = r.bytes;
      state.p2pRecvs.push_back(p);
      if (it->done == it->data.size()) completeUnexpected(state, it);
      return;
    }
    Piece p;
    p.request = &r;
    p.data = r.data;
    p.bytes = r.bytes;
    state.p2pRecvs.push_back(p);
    if (connection(r.peer, 0).closed) connectionFailed(connection(r.peer, 0), "connection closed earlier");
    return;
  }
  for (int i = 0; i < n; ++i) {
    Connection& c = connection(r.peer, i);
    if (c.closed) connectionFailed(c, "rank " + std::to_string(r.peer) + " closed its connection earlier");
    size_t begin = r.bytes * size_t(i) / size_t(n), end = r.bytes * size_t(i + 1) / size_t(n);
    Piece p;
    p.request = &r;
    p.data = r.data + begin;
    p.bytes = end - begin;
    p.header = makeFrameHeader(r.signature, uint8_t(i), p.bytes);  // what we expect to see
    c.collectiveRecvs.push_back(p);
  }
}

bool TcpTransport::writeSome(Connection& c) {
  bool moved = false;
  while (c.writable && !c.sends.empty()) {
    Piece& p = c.sends.front();
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
      completePiece(p.request);
      c.sends.pop_front();
    }
  }
  return moved;
}

bool TcpTransport::wantsHeader(const Connection& c) const {
  return !c.collectiveRecvs.empty() ||
         (c.index == 0 && (!peers_[size_t(c.peer)].p2pRecvs.empty() || !anyRecvs_.empty()));
}

bool TcpTransport::readSome(Connection& c) {
  bool moved = false;
  while (c.readable && !c.closed) {
    if (!c.haveHeader) {
      if (!wantsHeader(c)) break;  // nothing posted: leave the bytes in the kernel (backpressure)
      ssize_t n = ::recv(c.fd.get(), reinterpret_cast<char*>(&c.header) + c.headerGot,
                         sizeof(FrameHeader) - c.headerGot, MSG_DONTWAIT);
      if (n == 0) connectionFailed(c, "rank " + std::to_string(c.peer) + " closed the connection");
      if (n < 0) {
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) {
          c.readable = false;
          break;
        }
        connectionFailed(c, systemErrorText("recv", errno));
      }
      moved = true;
      c.headerGot += size_t(n);
      if (c.headerGot < sizeof(FrameHeader)) continue;
      c.signature = parseFrameHeader(c.header, c.peer);
      c.haveHeader = true;
    }
    if (!c.target && !c.unexpected && !matchIncoming(c)) break;  // collective not posted yet
    char* dst = c.target ? c.target->data : c.unexpected->data.data();
    size_t& done = c.target ? c.target->done : c.unexpected->done;
    size_t total = c.header.bytes;
    if (done < total) {
      ssize_t n = ::recv(c.fd.get(), dst + done, total - done, MSG_DONTWAIT);
      if (n == 0) connectionFailed(c, "rank " + std::to_string(c.peer) + " closed the connection");
      if (n < 0) {
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) {
          c.readable = false;
          break;
        }
        connectionFailed(c, systemErrorText("recv", errno));
      }
      moved = true;
      done += size_t(n);
    }
    if (done == total) finishIncoming(c);
  }
  return moved;
}

// Pairs the header just read with what this rank posted. A collective message must be the
// one the next posted receive expects: anything else means the ranks' calls diverged.
bool TcpTransport::matchIncoming(Connection& c) {
  const Signature& got = c.signature;
  if (got.op == OpCode::PointToPoint) {
    // Senders put point-to-point messages whole on connection 0. One arriving elsewhere could
    // pair with the receive connection 0 is filling, which the first to finish frees.
    DDLCOMM_CHECK(c.index == 0 && c.header.piece == 0, ErrorKind::Protocol, "rank ", c.peer,
                  " sent a point-to-point message as piece ", int(c.header.piece), " on connection ", c.index,
                  ": they travel whole on connection 0");
    PeerState& state = peers_[size_t(c.peer)];
    bool earlierUnexpected = std::any_of(state.unexpected.begin(), state.unexpected.end(),
                                         [&](const Unexpected& u) { return u.signature.seq == got.seq; });
    if (!earlierUnexpected) {
      for (Piece& p : state.p2pRecvs) {
        if (p.request->signature.seq != got.seq) continue;
        if (p.request->signature != got || p.bytes != c.header.bytes) {
          fail(ErrorKind::Mismatch, "rank ", rank_, " posted a receive for ", p.request->signature.describe(), ", ",
               humanBytes(p.bytes), ", but rank ", c.peer, " sent ", got.describe(), ", ",
               humanBytes(c.header.bytes));
        }
        c.target = &p;
        return true;
      }
      // No receive names this rank: the first receive from any rank with this tag takes it.
      for (auto p = anyRecvs_.begin(); p != anyRecvs_.end(); ++p) {
        if (p->request->signature.seq != got.seq) continue;
        checkP2pMatch(*p, c.peer, got, c.header.bytes);
        p->request->peer = c.peer;
        state.p2pRecvs.splice(state.p2pRecvs.end(), anyRecvs_, p);  // the node, and c.target, stay put
        c.target = &state.p2pRecvs.back();
        return true;
      }
    }
    DDLCOMM_CHECK(c.header.bytes <= options_.maxUnexpectedBytes, ErrorKind::Protocol, "rank ", c.peer,
                  " sent an unmatched message of ", c.header.bytes, " bytes, over the limit of ",
                  options_.maxUnexpectedBytes);
    state.unexpected.push_back(Unexpected{got, std::vector<char>(c.header.bytes), 0});
    c.unexpected = &state.unexpected.back();
    return true;
  }
  if (c.collectiveRecvs.empty()) return false;
  Piece& want = c.collectiveRecvs.front();
  const Signature& expected = want.request->signature;
  if (expected != got || want.bytes != c.header.bytes || want.header.piece != c.header.piece) {
    fail(ErrorKind::Mismatch, "collective mismatch between rank ", rank_, " and rank ", c.peer, ": rank ", rank_,
         " is in ", expected.describe(), " expecting ", humanBytes(want.bytes), ", but rank ", c.peer, " sent ",
         got.describe(), " with ", humanBytes(c.header.bytes),
         ". All ranks must call the same collectives in the same order with the same sizes and dtypes");
  }
  c.target = &want;
  return true;
}

void TcpTransport::finishIncoming(Connection& c) {
  PeerState& state = peers_[size_t(c.peer)];
  if (c.target) {
    Request* r = c.target->request;
    if (c.signature.op == OpCode::PointToPoint) {
      state.p2pRecvs.remove_if([&](const Piece& p) { return &p == c.target; });
    } else {
      c.collectiveRecvs.pop_front();
    }
    completePiece(r);
  } else {
    for (auto it = state.unexpected.begin(); it != state.unexpected.end(); ++it) {
      if (&*it == c.unexpected) {
        completeUnexpected(state, it);
        break;
      }
    }
  }
  c.target = nullptr;
  c.unexpected = nullptr;
  c.haveHeader = false;
  c.headerGot = 0;
}

// An unexpected message is complete: hand it to the first posted receive with its tag.
void TcpTransport::completeUnexpected(PeerState& state, std::list<Unexpected>::iterator it) {
  for (auto p = state.p2pRecvs.begin(); p != state.p2pRecvs.end(); ++p) {
    if (p->request->signature.seq != it->signature.seq) continue;
    // Only the oldest unexpected message with this tag may match.
    for (auto older = state.unexpected.begin(); older != it; ++older) {
      if (older->signature.seq == it->signature.seq) return;
    }
    if (p->request->signature != it->signature || p->bytes != it->data.size()) {
      fail(ErrorKind::Mismatch, "rank ", rank_, " posted a receive for ", p->request->signature.describe(), ", ",
           humanBytes(p->bytes), ", but rank ", p->request->peer, " sent ", it->signature.describe(), ", ",
           humanBytes(it->data.size()));
    }
    if (!it->data.empty()) std::memcpy(p->data, it->data.data(), it->data.size());
    Request* r = p->request;
    state.p2pRecvs.erase(p);
    state.unexpected.erase(it);
    completePiece(r);
    return;
  }
  matchAnySource();
}

void TcpTransport::checkP2pMatch(const Piece& p, int peer, const Signature& got, size_t bytes) {
  if (p.request->signature != got || p.bytes != bytes) {
    fail(ErrorKind::Mismatch, "rank ", rank_, " posted a receive for ", p.request->signature.describe(), ", ",
         humanBytes(p.bytes), " from any rank, but rank ", peer, " sent ", got.describe(), ", ", humanBytes(bytes));
  }
}

void TcpTransport::matchAnySource() {
  for (auto p = anyRecvs_.begin(); p != anyRecvs_.end();) {
    const uint64_t tag = p->request->signature.seq;
    bool matched = false;
    for (int peer = 0; peer < size_ && !matched; ++peer) {
      PeerState& state = peers_[size_t(peer)];
      // Only this rank's oldest message with the tag, complete, and wanted by no receive naming the rank.
      auto it = std::find_if(state.unexpected.begin(), state.unexpected.end(),
                             [&](const Unexpected& u) { return u.signature.seq == tag; });
      if (it == state.unexpected.end() || it->done != it->data.size()) continue;
      if (std::any_of(state.p2pRecvs.begin(), state.p2pRecvs.end(),
                      [&](const Piece& q) { return q.request->signature.seq == tag; })) {
        continue;
      }
      checkP2pMatch(*p, peer, it->signature, it->data.size());
      if (!it->data.empty()) std::memcpy(p->data, it->data.data(), it->data.size());
      Request* r = p->request;
      r->peer = peer;
      state.unexpected.erase(it);
      p = anyRecvs_.erase(p);
      completePiece(r);
      matched = true;
    }
    if (!matched) ++p;
  }
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
  while (!r.done()) {
    throwIfBroken();
    if (pumpAll()) continue;
    if (r.done()) break;
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) timedOut(r);
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
  s.connectionsPerPeer.assign(size_t(size_), 0);
  for (const Connection& c : connections_) {
    if (c.peer == rank_ || !c.fd.valid()) continue;
    tcp_info info{};
    socklen_t length = sizeof info;
    if (getsockopt(c.fd.get(), IPPROTO_TCP, TCP_INFO, &info, &length) != 0) continue;
    if (info.tcpi_state == 1) ++s.connectionsPerPeer[size_t(c.peer)];  // TCP_ESTABLISHED (uapi names no states)
    // Kernels before 4.19 return a shorter struct: the counters are then left out (0).
    if (length >= offsetof(tcp_info, tcpi_bytes_sent) + sizeof info.tcpi_bytes_sent) s.bytesSent += info.tcpi_bytes_sent;
  }
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
    for (const Piece& p : c.sends) {
      if (p.request == &r) progress += detail::concat(" sent ", p.done, " of ", p.bytes, " bytes;");
    }
    for (const Piece& p : c.collectiveRecvs) {
      if (p.request == &r) progress += detail::concat(" received ", p.done, " of ", p.bytes, " bytes;");
    }
  }
  std::string message =
      detail::concat("rank ", rank_, " timed out in ", r.signature.describe(), " waiting for rank ", r.peer, ":",
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
  auto failAll = [](auto& pieces) {
    for (auto& p : pieces) {
      p.request->failed = true;
      p.request->piecesLeft = 0;
    }
    pieces.clear();
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
