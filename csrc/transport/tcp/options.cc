#include "transport/tcp/options.h"

#include <cstdint>
#include <limits>

#include "common/env.h"

namespace ddlcomm::tcp {

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

}  // namespace ddlcomm::tcp
