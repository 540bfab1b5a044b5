// TCP transport: a full mesh of non-blocking sockets (optionally several per peer pair,
// with large messages striped across them), driven by edge-triggered epoll from the thread
// that waits. Messages are framed by FrameHeader and matched in order per connection; a
// receiver that has posted nothing for a connection does not read it, so TCP flow control
// holds the sender back instead of this process buffering unbounded data.
//
// One class, its parts in one file each: options.cc (environment), mesh.cc (connecting every
// peer), connection.cc (one connection's send and receive state machine), matching.cc (which
// posted receive an arriving message fills: collective, point-to-point, any source), and
// tcp_transport.cc (posting, progress, wait, timeout and abort).
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <list>
#include <memory>
#include <string>
#include <vector>

#include "transport/store.h"
#include "transport/tcp/options.h"
#include "transport/tcp/socket.h"
#include "transport/transport.h"

namespace ddlcomm::tcp {

class TcpTransport final : public Transport {
 public:
  // Publishes this rank's address in `store`, connects to every peer and returns once the
  // full mesh is up. Throws Error(Timeout) if peers do not show up in time.
  static std::unique_ptr<TcpTransport> connect(int rank, int size, KeyValueStore& store, const TcpOptions& options);
  ~TcpTransport() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  void postSend(Request& request) override;
  void postRecv(Request& request) override;
  void wait(Request& request, Deadline deadline) override;
  void poll(std::chrono::milliseconds timeout) override;
  void wakeup() override;
  void abort(ErrorKind kind, const std::string& reason) noexcept override;
  void throwIfBroken() const override;
  TransportStats stats() const override;

 private:
  // The part of a message that travels on one connection: all of it, or one stripe of a
  // message split over connectionsPerPeer connections.
  struct Stripe {
    Request* request = nullptr;
    char* data = nullptr;
    size_t bytes = 0;
    size_t done = 0;
    FrameHeader header{};  // what a send writes first
    size_t headerDone = 0;
  };
  // A point-to-point message that arrived before its receive was posted.
  struct Unexpected {
    Signature signature;
    std::vector<char> data;
    size_t done = 0;
  };
  struct Connection {
    int peer = -1;
    int index = 0;
    Fd fd;
    bool readable = false;
    bool writable = true;
    bool closed = false;
    std::deque<Stripe> sends;
    std::deque<Stripe> collectiveRecvs;
    // Receive side state machine: header, then payload into `target` or `unexpected`.
    FrameHeader header{};
    size_t headerGot = 0;
    bool haveHeader = false;
    Signature signature;
    Stripe* target = nullptr;
    Unexpected* unexpected = nullptr;
  };
  struct PeerState {
    std::list<Stripe> p2pRecvs;         // posted, unmatched
    std::list<Unexpected> unexpected;  // arrived, unmatched (in arrival order)
  };
  // Point-to-point receives from any rank, in posting order: each becomes a receive from the
  // first rank whose message with its tag arrives, after the receives naming that rank.
  std::list<Stripe> anyRecvs_;

  // epoll data of the wakeup eventfd; a connection's is its slot in connections_.
  static constexpr uint64_t kWakeToken = ~uint64_t(0);

  // mesh.cc
  TcpTransport(int rank, int size, const TcpOptions& options);
  void establish(KeyValueStore& store);
  Connection& connection(int peer, int index) { return connections_[size_t(peer) * options_.connectionsPerPeer + index]; }

  // tcp_transport.cc
  int stripeCount(const Request& request) const;
  // Stripe `i` of `n` of the request's message, with the header that goes before it.
  static Stripe stripeOf(Request& request, int i, int n);
  void postSendUnguarded(Request& request);
  void postRecvUnguarded(Request& request);
  void checkPeer(int peer, const char* what) const;
  bool pumpAll();  // non-blocking I/O on every connection; true if any byte moved
  bool waitForEvents(int timeoutMs);
  [[noreturn]] void timedOut(const Request& request);
  static void completeStripe(Request* request) { --request->transfersLeft; }

  // connection.cc
  bool writeSome(Connection& c);
  bool readSome(Connection& c);
  // recv() into dst[0, bytes), bytes > 0: how many arrived, or 0 when none are there now.
  size_t receiveSome(Connection& c, char* dst, size_t bytes);
  [[noreturn]] void connectionFailed(Connection& c, const std::string& what);

  // matching.cc
  void postP2pRecv(Request& request);
  // Whether a posted receive could take the next message on `c`; if none, `c` is not read.
  bool wantsHeader(const Connection& c) const;
  bool matchIncoming(Connection& c);
  void finishIncoming(Connection& c);
  void completeUnexpected(PeerState& state, std::list<Unexpected>::iterator it);
  // Hands complete unexpected messages to the posted receives from any rank.
  void matchAnySource();
  // Fails unless the receive `p` can take a message `got` of `bytes` from `peer`.
  void checkP2pMatch(const Stripe& p, int peer, const Signature& got, size_t bytes);

  const int rank_;
  const int size_;
  const TcpOptions options_;
  std::vector<Connection> connections_;  // [peer * connectionsPerPeer + index]; own slots unused
  std::vector<PeerState> peers_;
  Fd epoll_;
  Fd wakeFd_;
  bool broken_ = false;
  ErrorKind brokenKind_ = ErrorKind::Aborted;
  std::string brokenReason_;
};

}  // namespace ddlcomm::tcp
