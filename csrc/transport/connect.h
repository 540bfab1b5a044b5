// Chooses and connects a group's transport (its ddlcomm.Options, else DDLCOMM_TRANSPORT) from the
// table in connect.cc: one network transport (tcp/, or ucx/ where built) between all ranks, with
// shm/ layered over it for the ranks that share a host. Everything above sees one Transport.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "transport/store.h"
#include "transport/topology.h"
#include "transport/transport.h"

namespace ddlcomm {

// What one group asks for itself (ProcessGroupDdlcomm.Options), over the environment.
struct TransportRequest {
  std::optional<std::string> name;  // unset: DDLCOMM_TRANSPORT, else auto
  std::map<std::string, int64_t> spinMicros;  // by transport name, over DDLCOMM_<NAME>_SPIN_US
};

// Throws InvalidArgument unless `request` names "auto" or a transport of this build, and spins
// of known transports within 0..1000000 us; the messages name ddlcomm.Options' fields. Its
// check of the name is the one DDLCOMM_TRANSPORT goes through too.
void checkTransportRequest(const TransportRequest& request);

struct TransportOptions {
  std::string choice = "auto";  // "auto" or a name of transportNames()
  std::chrono::milliseconds connectTimeout{std::chrono::minutes(5)};
  // How long a waiting rank polls before it sleeps, by transport name (DDLCOMM_TCP_SPIN_US,
  // DDLCOMM_SHM_SPIN_US, DDLCOMM_UCX_SPIN_US); a transport not listed lets connectTransport choose.
  std::map<std::string, std::chrono::microseconds> spin;

  // `request`'s choices where it makes them, else DDLCOMM_TRANSPORT and the spin variables
  // (all read and checked either way, so a bad value fails whichever wins); throws
  // InvalidArgument for an unknown name, or for a transport this build left out.
  static TransportOptions resolve(const TransportRequest& request, std::chrono::milliseconds connectTimeout);
};

// The DDLCOMM_TRANSPORT values this build supports besides auto, in the table's order.
std::vector<std::string> transportNames();

struct Connection {
  std::unique_ptr<Transport> transport;
  Topology topology;  // the records the choices were taken from
};

// Connects rank `rank` of `size` through `store`; returns once every peer is reachable.
// `network`, when given, is a transport that already reaches every peer (another backend's
// send and recv): it takes the place of the table's network entries, and the layers that
// apply (shared memory between the ranks of a host) go over it.
Connection connectTransport(int rank, int size, KeyValueStore& store, const TransportOptions& options,
                            std::unique_ptr<Transport> network = nullptr);

}  // namespace ddlcomm
