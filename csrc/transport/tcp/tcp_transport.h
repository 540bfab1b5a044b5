// TCP transport: a full mesh of non-blocking sockets (optionally several per peer pair,
// with large messages striped across them), driven by edge-triggered epoll from the thread
// that waits. Messages are framed by FrameHeader and matched in order per connection; a
// receiver that has posted nothing for a connection does not read it, so TCP flow control
// holds the sender back instead of this process buffering unbounded data.
#pragma once

#include <chrono>
#include <deque>
#include <list>
#include <memory>
#include <string>
#include <vector>

#include "transport/store.h"
#include "transport/tcp/socket.h"
#include "transport/transport.h"

namespace ddlcomm::tcp {

struct TcpOptions {
  std::string host;                 // listen address; empty means chooseLocalHost()
  int connectionsPerPeer = 1;       // DDLCOMM_SOCKETS_PER_PEER
  size_t stripeMinBytes = 1 << 20;  // DDLCOMM_STRIPE_MIN_BYTES: smaller messages use one connection
  int socketBufferBytes = 0;        // DDLCOMM_SOCKET_BUFFER_BYTES; 0 keeps kernel autotuning
  size_t maxUnexpectedBytes = size_t(1) << 32;  // cap on one unmatched point-to-point message
  std::chrono::milliseconds connectTimeout{std::chrono::minutes(5)};
  // DDLCOMM_HANDSHAKE_TIMEOUT_MS: how long a connection may take to prove the group key
  // before it is dropped (a real peer needs one round trip).
  std::chrono::milliseconds handshakeTimeout{std::chrono::seconds(10)};

  static TcpOptions fromEnvironment();
};

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

  std::string localAddress() const { return localAddress_; }

 private:
  struct Piece {
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
    std::deque<Piece> sends;
    std::deque<Piece> collectiveRecvs;
    // Receive side state machine: header, then payload into `target` or `unexpected`.
    FrameHeader header{};
    size_t headerGot = 0;
    bool haveHeader = false;
    Signature signature;
    Piece* target = nullptr;
    Unexpected* unexpected = nullptr;
  };
  struct PeerState {
    std::list<Piece> p2pRecvs;         // posted, unmatched
    std::list<Unexpected> unexpected;  // arrived, unmatched (in arrival order)
  };
  // Point-to-point receives from any rank, in posting order: each becomes a receive from the
  // first rank whose message with its tag arrives, after the receives naming that rank.
  std::list<Piece> anyRecvs_;

  TcpTransport(int rank, int size, const TcpOptions& options);
  void establish(KeyValueStore& store);
  Connection& connection(int peer, int index) { return connections_[size_t(peer) * options_.connectionsPerPeer + index]; }
  int pieceCount(const Request& request) const;
  void postSendUnguarded(Request& request);
  void postRecvUnguarded(Request& request);
  void checkPeer(int peer, const char* what) const;

  bool pumpAll();  // non-blocking I/O on every connection; true if any byte moved
  bool writeSome(Connection& c);
  bool readSome(Connection& c);
  bool wantsHeader(const Connection& c) const;
  bool matchIncoming(Connection& c);
  void finishIncoming(Connection& c);
  void completeUnexpected(PeerState& state, std::list<Unexpected>::iterator it);
  // Hands complete unexpected messages to the posted receives from any rank.
  void matchAnySource();
  // Fails unless the receive `p` can take a message `got` of `bytes` from `peer`.
  void checkP2pMatch(const Piece& p, int peer, const Signature& got, size_t bytes);
  [[noreturn]] void connectionFailed(Connection& c, const std::string& what);
  bool waitForEvents(int timeoutMs);
  [[noreturn]] void timedOut(const Request& request);
  static void completePiece(Request* request) { --request->piecesLeft; }

  const int rank_;
  const int size_;
  const TcpOptions options_;
  std::vector<Connection> connections_;  // [peer * connectionsPerPeer + index]; own slots unused
  std::vector<PeerState> peers_;
  Fd epoll_;
  Fd wakeFd_;
  std::string localAddress_;
  bool broken_ = false;
  ErrorKind brokenKind_ = ErrorKind::Aborted;
  std::string brokenReason_;
};

}  // namespace ddlcomm::tcp
