// Connection set-up between ranks. Every connection is authenticated before either side
// believes a byte from the other: the acceptor sends a random challenge, the connector
// answers with its Hello and an HMAC-SHA256 over both nonces and the Hello under the
// group key (transport/handshake.h), and the acceptor proves the key back the same way.
//
// The acceptor serves many half-open connections at once, each with its own deadline, so
// a client that sends garbage, the wrong key, nothing at all, or a flood of connections
// is dropped and logged without delaying the real peers.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <deque>
#include <string>

#include "common/sha256.h"
#include "transport/handshake.h"
#include "transport/store.h"
#include "transport/tcp/socket.h"

namespace ddlcomm::tcp {

using transport::Nonce;

// Who is calling and for which slot; exchanged inside the authenticated handshake.
struct Hello {
  uint32_t magic;
  uint32_t version;
  int32_t rank;
  int32_t size;
  int32_t index;  // which of the connections between this pair of ranks
  int32_t connectionsPerPeer;
};
Hello makeHello(int rank, int size, int connectionsPerPeer);

// Connector side: connects to `address` and authenticates both ways, retrying while the
// acceptor drops the connection (it may be shedding a flood) until `deadline`. Returns the
// socket and the acceptor's Hello. A rejected proof (the ranks disagree on the key) throws
// at once instead of retrying.
Fd connectAuthenticated(const Address& address, const std::string& peerName, const std::string& key,
                        const Hello& mine, Deadline deadline, Hello* theirs);

// Acceptor side: owns the listening socket and the connections that have not yet proved
// the key.
class Acceptor {
 public:
  Acceptor(Fd listener, std::string key, const Hello& mine, std::chrono::milliseconds handshakeTimeout);
  ~Acceptor();
  Acceptor(const Acceptor&) = delete;
  Acceptor& operator=(const Acceptor&) = delete;

  // Blocks until a client proves the key; returns its socket (blocking mode) and Hello.
  // Throws Error(Timeout) at `deadline`.
  Fd next(Deadline deadline, Hello* hello);

 private:
  static constexpr size_t kProofBytes = sizeof(Hello) + sizeof(Nonce) + sizeof(Digest);
  struct Pending {
    Fd fd;
    std::string from;
    Deadline deadline;
    Nonce nonce{};
    std::array<uint8_t, kProofBytes> proof{};
    size_t got = 0;
  };

  enum Reason { kBadProof, kTooSlow, kClosed, kEvicted, kSocketError, kReasons };

  void acceptSome();
  // Reads what `p` sent; true once it has proved the key (and been answered).
  bool advance(Pending& p, Hello* hello);
  void drop(Pending& p, Reason reason, const std::string& why);

  Fd listener_;
  const std::string key_;
  const Hello mine_;
  const std::chrono::milliseconds handshakeTimeout_;
  std::deque<Pending> pending_;  // oldest first
  std::array<size_t, kReasons> dropped_{};
};

}  // namespace ddlcomm::tcp
