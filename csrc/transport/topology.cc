#include "transport/topology.h"

#include <map>

#include "common/error.h"
#include "transport/host.h"

namespace ddlcomm {
namespace {

std::string recordKey(int rank) { return "ddlcomm/rank/" + std::to_string(rank); }

// A record: the machine's identity (a boot id), the host's and "rdma" or "-", one space
// between (the identities hold none).
std::string record() { return machineIdentity() + " " + hostIdentity() + (rdmaDevicePresent() ? " rdma" : " -"); }

// Hosts numbered in order of their lowest rank.
int hostNumber(std::map<std::string, int>& numbers, const std::string& identity) {
  return numbers.emplace(identity, int(numbers.size())).first->second;
}

}  // namespace

void Topology::publish(KeyValueStore& store, int rank) { store.set(recordKey(rank), record()); }

Topology Topology::read(KeyValueStore& store, int rank, int size) {
  const std::string mine = record();
  const std::string machine = mine.substr(0, mine.find(' '));
  std::map<std::string, int> numbers;
  std::vector<int> hostOf(static_cast<size_t>(size));
  int onThisMachine = 0, firstWithoutRdma = -1;
  for (int r = 0; r < size; ++r) {
    const std::string theirs = r == rank ? mine : store.get(recordKey(r));
    const size_t space = theirs.find(' '), last = theirs.rfind(' ');
    DDLCOMM_CHECK(space != std::string::npos && last > space, ErrorKind::Protocol, "rank ", r,
                  " published a malformed host record (mixed ddlcomm versions in one job?)");
    hostOf[size_t(r)] = hostNumber(numbers, theirs.substr(space + 1, last - space - 1));
    if (theirs.compare(0, space, machine) == 0 && space == machine.size()) ++onThisMachine;
    if (firstWithoutRdma < 0 && theirs.compare(last + 1, std::string::npos, "rdma") != 0) firstWithoutRdma = r;
  }
  return Topology(std::move(hostOf), rank, onThisMachine, firstWithoutRdma);
}

Topology Topology::ofHosts(const std::vector<std::string>& identities, int rank) {
  std::map<std::string, int> numbers;
  std::vector<int> hostOf;
  for (const std::string& identity : identities) hostOf.push_back(hostNumber(numbers, identity));
  return Topology(std::move(hostOf), rank, 1, -1);
}

Topology::Topology(std::vector<int> hostOf, int rank, int onThisMachine, int firstWithoutRdma)
    : hostOf_(std::move(hostOf)), rank_(rank), onThisMachine_(onThisMachine),
      firstWithoutRdma_(firstWithoutRdma) {
  for (size_t r = 0; r < hostOf_.size(); ++r) {
    const size_t host = size_t(hostOf_[r]);
    if (members_.size() <= host) members_.resize(host + 1);
    members_[host].push_back(int(r));
  }
}

bool Topology::uniform() const {
  for (const auto& host : members_) {
    if (host.size() != members_.front().size()) return false;
  }
  return true;
}

std::vector<int> Topology::peersAcrossHosts() const {
  const std::vector<int>& mine = hostRanks();
  size_t local = 0;
  while (mine[local] != rank_) ++local;
  std::vector<int> peers;
  for (const auto& host : members_) peers.push_back(host.at(local));
  return peers;
}

std::string Topology::describe() const {
  if (uniform()) return detail::concat(hosts(), hosts() == 1 ? " host x " : " hosts x ", members_.front().size(),
                                       members_.front().size() == 1 ? " rank" : " ranks");
  std::string sizes;
  for (size_t h = 0; h < members_.size(); ++h) {
    sizes += detail::concat(h == 0 ? "" : h + 1 == members_.size() ? " and " : ", ", members_[h].size());
  }
  return detail::concat(hosts(), " hosts of ", sizes, " ranks");
}

}  // namespace ddlcomm
