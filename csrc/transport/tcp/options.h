// The TCP transport's settings, read from the environment once before connecting.
#pragma once

#include <chrono>
#include <cstddef>
#include <string>

namespace ddlcomm::tcp {

struct TcpOptions {
  std::string host;                 // listen address; empty means chooseLocalHost()
  int connectionsPerPeer = 1;       // DDLCOMM_SOCKETS_PER_PEER
  // DDLCOMM_STRIPE_MIN_BYTES: smaller messages use one connection. Below the collectives'
  // 512 KiB segments, so that a ring's messages spread over the connections
  // (docs/transports.md, "Several connections per peer").
  size_t stripeMinBytes = 256 << 10;
  int socketBufferBytes = 0;        // DDLCOMM_SOCKET_BUFFER_BYTES; 0 keeps kernel autotuning
  size_t maxUnexpectedBytes = size_t(1) << 32;  // cap on one unmatched point-to-point message
  std::chrono::milliseconds connectTimeout{std::chrono::minutes(5)};
  // DDLCOMM_HANDSHAKE_TIMEOUT_MS: how long a connection may take to prove the group key
  // before it is dropped (a real peer needs one round trip).
  std::chrono::milliseconds handshakeTimeout{std::chrono::seconds(10)};

  static TcpOptions fromEnvironment();
};

}  // namespace ddlcomm::tcp
