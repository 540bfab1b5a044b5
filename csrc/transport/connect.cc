#include "transport/connect.h"

#include <cstring>
#include <fstream>

#include "common/cores.h"
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
  o.tcpSpin = std::chrono::microseconds(envInteger("DDLCOMM_TCP_SPIN_US", -1, 0, 1000000));
  o.ucxSpin = std::chrono::microseconds(envInteger("DDLCOMM_UCX_SPIN_US", -1, 0, 1000000));
  return o;
}

namespace {

std::string bootKey(int rank) { return "ddlcomm/boot/" + std::to_string(rank); }

std::string bootId() {
  std::ifstream file("/proc/sys/kernel/random/boot_id");
  std::string boot;
  std::getline(file, boot);
  return boot;
}

// The ranks of the group on this machine (same boot id), this one included: they share its
// cores. Read once the network is connected, so every rank has published its boot id.
int ranksOnThisHost(int rank, int size, KeyValueStore& store) {
  const std::string mine = bootId();
  int count = 1;
  for (int r = 0; r < size; ++r) {
    if (r != rank && store.get(bootKey(r)) == mine) ++count;
  }
  return count;
}

}  // namespace

std::unique_ptr<Transport> connectTransport(int rank, int size, KeyValueStore& store,
                                            const TransportOptions& options) {
  // Every setting is read before connecting: a bad value fails at once, not after the peers joined.
  auto tcpOptions = tcp::TcpOptions::fromEnvironment();
  tcpOptions.connectTimeout = options.connectTimeout;
  auto shmOptions = shm::ShmOptions::fromEnvironment();
  shmOptions.required = options.choice == TransportChoice::Shm;
  store.set(bootKey(rank), bootId());

  // A waiting rank spins a little before it sleeps: waking from a sleep costs more than a
  // small message takes. Where this host's ranks outnumber its cores a long spin holds the
  // core its peer needs, so there a short one yields between polls (10 us; shared memory 5 us).
  // Measured against no spin: docs/results/transports.md, "Spinning before sleeping". Decided
  // once the network is connected (see ranksOnThisHost).
  using std::chrono::microseconds;
  auto spinOr = [&](microseconds chosen) {
    const bool oversubscribed = size > 1 && ranksOnThisHost(rank, size, store) > usableCores();
    shmOptions.spin.yield = oversubscribed;
    if (shmOptions.spin.duration.count() < 0) shmOptions.spin.duration = microseconds(oversubscribed ? 5 : 50);
    return SpinPolicy{chosen.count() >= 0 ? chosen : microseconds(oversubscribed ? 10 : 50), oversubscribed};
  };

  std::unique_ptr<Transport> network;
#ifdef DDLCOMM_WITH_UCX
  if (options.choice == TransportChoice::Ucx || (options.choice == TransportChoice::Auto && ucx::rdmaDevicePresent())) {
    auto ucx = ucx::UcxTransport::connect(rank, size, store, options.connectTimeout);
    ucx->setSpin(spinOr(options.ucxSpin));
    network = std::move(ucx);
  }
#endif
  if (!network) {
    auto tcp = tcp::TcpTransport::connect(rank, size, store, tcpOptions);
    tcp->setSpin(spinOr(options.tcpSpin));
    network = std::move(tcp);
  }
  // The network transport connects first: it proves the group key, so the store entries the
  // shared-memory layer then reads were written by members of this group.
  if (options.choice == TransportChoice::Auto || options.choice == TransportChoice::Shm) {
    return shm::ShmTransport::layer(std::move(network), store, shmOptions);
  }
  return network;
}

}  // namespace ddlcomm
