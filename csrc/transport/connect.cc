#include "transport/connect.h"

#include <iterator>
#include <optional>

#include "common/cores.h"
#include "common/env.h"
#include "transport/host.h"
#include "transport/shm/shm_transport.h"
#include "transport/tcp/tcp_transport.h"
#ifdef DDLCOMM_WITH_UCX
#include "transport/ucx/ucx_transport.h"
#endif

namespace ddlcomm {
namespace {

struct TransportEntry;

// What the transports' connect functions share: the settings, all read before anything
// connects (a bad value fails at once, not after the peers joined), and the host's load.
class Setup {
 public:
  Setup(int rank, int size, KeyValueStore& store, const TransportOptions& options)
      : rank(rank), size(size), store(store), options(options),
        tcp(tcp::TcpOptions::fromEnvironment()), shm(shm::ShmOptions::fromEnvironment()) {
    tcp.connectTimeout = options.connectTimeout;
    Topology::publish(store, rank);  // DDLCOMM_HOST_ID is checked here, with the other settings
  }

  // How `entry` waits: its DDLCOMM_*_SPIN_US, else its default for this host's load.
  SpinPolicy spin(const TransportEntry& entry);

  // Every rank's record, read when a choice first needs it: once the network is connected,
  // or before when auto may choose UCX on a rank with an RDMA device (see ucxApplies). Every
  // rank publishes before it connects, so the reads wait at most for the slowest to start.
  const Topology& topology() {
    if (!topology_) topology_ = Topology::read(store, rank, size);
    return *topology_;
  }

  const int rank;
  const int size;
  KeyValueStore& store;
  const TransportOptions& options;
  tcp::TcpOptions tcp;
  shm::ShmOptions shm;

 private:
  std::optional<bool> oversubscribed_;
  std::optional<Topology> topology_;
};

// One row of the transport table, as NCCL's: the choice walks the table, asking each built
// entry whether it applies to the group under its choice (Options.transport, DDLCOMM_TRANSPORT).
struct TransportEntry {
  enum Role {
    Network,  // connects every pair of ranks; the last network entry that applies is taken
    Layer,    // wraps the network for the ranks it can reach itself
  };
  const char* name;  // the choice's value, listed by ddlcomm.transports()
  bool built;
  const char* notBuilt;  // why `built` is false: the error when a choice names it
  Role role;
  // A waiting rank spins a little before it sleeps: waking from a sleep costs more than a
  // small message takes. Where this host's ranks outnumber its cores a long spin holds the
  // core its peer needs, so there a short one yields between polls. Measured against no
  // spin: docs/results/transports.md, "Spinning before sleeping".
  const char* spinVariable;
  int spinMicros;
  int oversubscribedSpinMicros;
  // From the choice and the records of every rank (setup.topology()), never from this rank's
  // facts alone: every rank must take the same entries.
  bool (*applies)(const TransportEntry& self, Setup& setup);
  // `network` is null for a Network entry, the transport to wrap for a Layer; a Layer may
  // hand `network` back when it reaches no peer itself.
  std::unique_ptr<Transport> (*connect)(Setup& setup, const TransportEntry& self, std::unique_ptr<Transport> network);
};

SpinPolicy Setup::spin(const TransportEntry& entry) {
  if (!oversubscribed_) oversubscribed_ = size > 1 && topology().ranksOnThisMachine() > usableCores();
  const auto chosen = options.spin.find(entry.name);
  const std::chrono::microseconds duration =
      chosen != options.spin.end() ? chosen->second
                                   : std::chrono::microseconds(*oversubscribed_ ? entry.oversubscribedSpinMicros
                                                                                : entry.spinMicros);
  return SpinPolicy{duration, *oversubscribed_};
}

std::unique_ptr<Transport> connectTcp(Setup& s, const TransportEntry& self, std::unique_ptr<Transport>) {
  std::unique_ptr<Transport> t = tcp::TcpTransport::connect(s.rank, s.size, s.store, s.tcp);
  t->setSpin(s.spin(self));
  return t;
}

// The network transport connects first: it proves the group key, so the store entries the
// shared-memory layer then reads were written by members of this group (another backend's,
// given, has no key: its group's store is trusted as that backend trusts it).
std::unique_ptr<Transport> layerShm(Setup& s, const TransportEntry& self, std::unique_ptr<Transport> network) {
  shm::ShmOptions options = s.shm;
  options.required = s.options.choice == self.name;  // every rank must be local, no fallback
  options.wholeGroupOnly = !network->pollProgresses();
  return shm::ShmTransport::layer(std::move(network), s.store, options, s.spin(self));
}

#ifdef DDLCOMM_WITH_UCX
constexpr bool kUcxBuilt = true;
// Named, or auto when every rank's machine has an RDMA device. A rank without one knows the
// answer (no) without the others' records; one with it reads them before anything connects,
// which is the only case that waits on the store rather than in the network's handshake (whose
// errors name a missing rank or a disagreeing world size).
bool ucxApplies(const TransportEntry& self, Setup& s) {
  if (s.options.choice != "auto") return s.options.choice == self.name;
  return rdmaDevicePresent() && s.topology().rdmaOnEveryRank();
}
std::unique_ptr<Transport> connectUcx(Setup& s, const TransportEntry& self, std::unique_ptr<Transport>) {
  std::unique_ptr<Transport> t = ucx::UcxTransport::connect(s.rank, s.size, s.store, s.options.connectTimeout);
  t->setSpin(s.spin(self));
  return t;
}
#else
constexpr bool kUcxBuilt = false;
bool ucxApplies(const TransportEntry&, Setup&) { return false; }
std::unique_ptr<Transport> connectUcx(Setup&, const TransportEntry&, std::unique_ptr<Transport>) {
  fail(ErrorKind::InvalidArgument, "this build of ddlcomm has no UCX transport");  // not built: never chosen
}
#endif

// In the order ddlcomm.transports() lists them. Network entries come in ascending
// preference: tcp, always applicable, is the fallback.
const TransportEntry kTransports[] = {
    {"tcp", true, nullptr, TransportEntry::Network, "DDLCOMM_TCP_SPIN_US", 50, 10,
     [](const TransportEntry&, Setup&) { return true; }, connectTcp},
    {"shm", true, nullptr, TransportEntry::Layer, "DDLCOMM_SHM_SPIN_US", 50, 5,
     [](const TransportEntry& self, Setup& s) { return s.options.choice == "auto" || s.options.choice == self.name; },
     layerShm},
    {"ucx", kUcxBuilt,
     "this build of ddlcomm has no UCX transport: UCX was not found (pkg-config ucx) when it was built",
     TransportEntry::Network,
     "DDLCOMM_UCX_SPIN_US", 50, 10, ucxApplies, connectUcx},
};

const TransportEntry* findTransport(const std::string& name) {
  for (const TransportEntry& e : kTransports) {
    if (name == e.name) return &e;
  }
  return nullptr;
}

// "auto, tcp, shm or ucx": every name the table knows, built or not (`withAuto` false: without auto).
std::string choices(bool withAuto = true) {
  std::string list = withAuto ? "auto" : "";
  const size_t n = std::size(kTransports);
  for (size_t i = 0; i < n; ++i) {
    if (!list.empty()) list += i + 1 == n ? " or " : ", ";
    list += kTransports[i].name;
  }
  return list;
}

// The one check of a transport's name, whether from the environment or a group's options:
// `what` names the setting, `unset` what leaving it out means.
void checkChoice(const std::string& name, const std::string& what, const char* unset) {
  const TransportEntry* e = findTransport(name);
  DDLCOMM_CHECK(e || name == "auto", ErrorKind::InvalidArgument, what, "='", name, "' is invalid: expected ",
                choices(), " (or ", unset, ")");
  DDLCOMM_CHECK(!e || e->built, ErrorKind::InvalidArgument, what, "='", name, "', but ", e ? e->notBuilt : "");
}

}  // namespace

void checkTransportRequest(const TransportRequest& request) {
  const std::string source = "ddlcomm.Options";  // as Python names the options that carry a request
  if (request.name) checkChoice(*request.name, source + ".transport", "None for DDLCOMM_TRANSPORT, else auto");
  for (const auto& [name, micros] : request.spinMicros) {
    // Any name of the table, as DDLCOMM_UCX_SPIN_US is accepted by a build without UCX.
    DDLCOMM_CHECK(findTransport(name), ErrorKind::InvalidArgument, source, ".spin_us['", name,
                  "'] is invalid: expected a key among ", choices(false));
    DDLCOMM_CHECK(micros >= 0 && micros <= 1000000, ErrorKind::InvalidArgument, source, ".spin_us['", name,
                  "']=", micros, " is invalid: expected microseconds from 0 to 1000000");
  }
}

TransportOptions TransportOptions::resolve(const TransportRequest& request, std::chrono::milliseconds connectTimeout) {
  checkTransportRequest(request);
  TransportOptions o;
  o.connectTimeout = connectTimeout;
  if (const char* name = envString("DDLCOMM_TRANSPORT")) {
    checkChoice(name, "environment variable DDLCOMM_TRANSPORT", "unset for auto");
    o.choice = name;
  }
  if (request.name) o.choice = *request.name;  // the group's own choice wins
  for (const TransportEntry& e : kTransports) {
    const int64_t micros = envInteger(e.spinVariable, -1, 0, 1000000);
    if (micros >= 0) o.spin[e.name] = std::chrono::microseconds(micros);
  }
  for (const auto& [name, micros] : request.spinMicros) o.spin[name] = std::chrono::microseconds(micros);
  return o;
}

std::vector<std::string> transportNames() {
  std::vector<std::string> names;
  for (const TransportEntry& e : kTransports) {
    if (e.built) names.push_back(e.name);
  }
  return names;
}

Connection connectTransport(int rank, int size, KeyValueStore& store, const TransportOptions& options,
                            std::unique_ptr<Transport> network) {
  Setup setup(rank, size, store, options);
  std::unique_ptr<Transport> transport = std::move(network);
  if (!transport) {
    const TransportEntry* chosen = nullptr;
    for (const TransportEntry& e : kTransports) {
      if (e.built && e.role == TransportEntry::Network && e.applies(e, setup)) chosen = &e;
    }
    transport = chosen->connect(setup, *chosen, nullptr);
  }
  for (const TransportEntry& e : kTransports) {
    if (e.built && e.role == TransportEntry::Layer && e.applies(e, setup)) {
      transport = e.connect(setup, e, std::move(transport));
    }
  }
  return Connection{std::move(transport), setup.topology()};
}

}  // namespace ddlcomm
