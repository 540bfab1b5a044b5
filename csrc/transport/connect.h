// Chooses and connects a group's transport (DDLCOMM_TRANSPORT) from the table in connect.cc:
// one network transport (tcp/, or ucx/ where built) between all ranks, with shm/ layered over
// it for the ranks that share a host. Everything above sees one Transport.
#pragma once

#include <chrono>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "transport/store.h"
#include "transport/transport.h"

namespace ddlcomm {

struct TransportOptions {
  std::string choice = "auto";  // DDLCOMM_TRANSPORT: "auto" or a name of transportNames()
  std::chrono::milliseconds connectTimeout{std::chrono::minutes(5)};
  // How long a waiting rank polls before it sleeps, by transport name (DDLCOMM_TCP_SPIN_US,
  // DDLCOMM_SHM_SPIN_US, DDLCOMM_UCX_SPIN_US); a transport not listed lets connectTransport choose.
  std::map<std::string, std::chrono::microseconds> spin;

  // Reads DDLCOMM_TRANSPORT and the spin variables; throws InvalidArgument for an unknown
  // name, or for a transport this build left out.
  static TransportOptions fromEnvironment(std::chrono::milliseconds connectTimeout);
};

// The DDLCOMM_TRANSPORT values this build supports besides auto, in the table's order.
std::vector<std::string> transportNames();

// Connects rank `rank` of `size` through `store`; returns once every peer is reachable.
std::unique_ptr<Transport> connectTransport(int rank, int size, KeyValueStore& store,
                                            const TransportOptions& options);

}  // namespace ddlcomm
