// Chooses and connects a group's transport (DDLCOMM_TRANSPORT): the network transport
// (tcp/, or ucx/ where built) between all ranks, with shm/ layered over it for the ranks
// that share a host. Everything above sees one Transport.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "transport/store.h"
#include "transport/transport.h"

namespace ddlcomm {

enum class TransportChoice { Auto, Tcp, Shm, Ucx };

struct TransportOptions {
  TransportChoice choice = TransportChoice::Auto;  // DDLCOMM_TRANSPORT
  std::chrono::milliseconds connectTimeout{std::chrono::minutes(5)};
  // How long a waiting rank polls before it sleeps: DDLCOMM_TCP_SPIN_US and
  // DDLCOMM_UCX_SPIN_US; negative (unset) lets connectTransport choose.
  std::chrono::microseconds tcpSpin{-1};
  std::chrono::microseconds ucxSpin{-1};

  // Reads DDLCOMM_TRANSPORT; throws InvalidArgument for an unknown name, or for ucx in a
  // build without UCX.
  static TransportOptions fromEnvironment(std::chrono::milliseconds connectTimeout);
};

const char* transportChoiceName(TransportChoice choice);
// Whether this build includes the UCX transport (UCX was found by pkg-config at build time).
bool ucxBuilt();

// Connects rank `rank` of `size` through `store`; returns once every peer is reachable.
std::unique_ptr<Transport> connectTransport(int rank, int size, KeyValueStore& store,
                                            const TransportOptions& options);

}  // namespace ddlcomm
