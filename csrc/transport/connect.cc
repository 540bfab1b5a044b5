#include "transport/connect.h"

#include <cstring>

#include "common/env.h"
#include "transport/shm/shm_transport.h"
#include "transport/tcp/tcp_transport.h"
#ifdef DDLCOMM_WITH_UCX
#include "transport/ucx/ucx_transport.h"
#endif

namespace ddlcomm {

const char* transportChoiceName(TransportChoice choice) {
  switch (choice) {
    case TransportChoice::Auto: return "auto";
    case TransportChoice::Tcp: return "tcp";
    case TransportChoice::Shm: return "shm";
    case TransportChoice::Ucx: return "ucx";
  }
  return "?";
}

bool ucxBuilt() {
#ifdef DDLCOMM_WITH_UCX
  return true;
#else
  return false;
#endif
}

TransportOptions TransportOptions::fromEnvironment(std::chrono::milliseconds connectTimeout) {
  TransportOptions o;
  o.connectTimeout = connectTimeout;
  if (const char* name = envString("DDLCOMM_TRANSPORT")) {
    bool known = false;
    for (TransportChoice c : {TransportChoice::Auto, TransportChoice::Tcp, TransportChoice::Shm, TransportChoice::Ucx}) {
      if (std::strcmp(name, transportChoiceName(c)) == 0) {
        o.choice = c;
        known = true;
      }
    }
    DDLCOMM_CHECK(known, ErrorKind::InvalidArgument, "environment variable DDLCOMM_TRANSPORT='", name,
                  "' is invalid: expected auto, tcp, shm or ucx (or unset for auto)");
    DDLCOMM_CHECK(o.choice != TransportChoice::Ucx || ucxBuilt(), ErrorKind::InvalidArgument,
                  "DDLCOMM_TRANSPORT=ucx, but this build of ddlcomm has no UCX transport: UCX was not found "
                  "(pkg-config ucx) when it was built");
  }
  return o;
}

std::unique_ptr<Transport> connectTransport(int rank, int size, KeyValueStore& store,
                                            const TransportOptions& options) {
  // Every setting is read before connecting: a bad value fails at once, not after the peers joined.
  auto tcpOptions = tcp::TcpOptions::fromEnvironment();
  tcpOptions.connectTimeout = options.connectTimeout;
  auto shmOptions = shm::ShmOptions::fromEnvironment();
  shmOptions.required = options.choice == TransportChoice::Shm;

  std::unique_ptr<Transport> network;
#ifdef DDLCOMM_WITH_UCX
  if (options.choice == TransportChoice::Ucx || (options.choice == TransportChoice::Auto && ucx::rdmaDevicePresent())) {
    network = ucx::UcxTransport::connect(rank, size, store, options.connectTimeout);
  }
#endif
  if (!network) network = tcp::TcpTransport::connect(rank, size, store, tcpOptions);
  // The network transport connects first: it proves the group key, so the store entries the
  // shared-memory layer then reads were written by members of this group.
  if (options.choice == TransportChoice::Auto || options.choice == TransportChoice::Shm) {
    return shm::ShmTransport::layer(std::move(network), store, shmOptions);
  }
  return network;
}

}  // namespace ddlcomm
