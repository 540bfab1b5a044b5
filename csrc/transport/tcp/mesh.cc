// Mesh set-up: every pair of ranks gets connectionsPerPeer authenticated connections, then
// every connection is made non-blocking and registered with epoll.
#include <sys/epoll.h>
#include <sys/eventfd.h>

#include <cerrno>

#include "transport/tcp/handshake.h"
#include "transport/tcp/tcp_transport.h"

namespace ddlcomm::tcp {

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
  const std::string key = transport::groupKey(store, rank_);
  Address bound;
  Fd listener = listenOn(options_.host.empty() ? chooseLocalHost() : options_.host, &bound);
  store.set("ddlcomm/addr/" + std::to_string(rank_), bound.toString());

  const Hello mine = makeHello(rank_, size_, k);
  // Only authenticated peers get here, so a disagreement is a misconfigured job: fatal.
  auto checkHello = [&](const Hello& h, const std::string& from) {
    DDLCOMM_CHECK(h.size == size_, ErrorKind::Mismatch, "peer ", from, " was started in a group of ", h.size,
                  " ranks, this rank in one of ", size_, " (the ranks disagree on the world size)");
    DDLCOMM_CHECK(h.connectionsPerPeer == k, ErrorKind::Mismatch, "peer ", from, " opens ", h.connectionsPerPeer,
                  " sockets per peer, this rank ", k, " (DDLCOMM_SOCKETS_PER_PEER must match)");
    DDLCOMM_CHECK(h.rank >= 0 && h.rank < size_ && h.index >= 0 && h.index < k, ErrorKind::Mismatch, "peer ", from,
                  " claims rank ", h.rank, " connection ", h.index, ", outside the group's ", size_, " ranks and ", k,
                  " connections");
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

}  // namespace ddlcomm::tcp
