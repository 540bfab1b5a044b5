// Which ranks of a group share a host, which a machine's cores, and which have RDMA devices:
// read once, at connect time, from the one record every rank publishes (host.h's facts), so
// that every rank takes the same decisions from the same facts.
#pragma once

#include <string>
#include <vector>

#include "transport/store.h"

namespace ddlcomm {

class Topology {
 public:
  // This rank's record, before the transports connect (they read the records afterwards).
  static void publish(KeyValueStore& store, int rank);
  // Every rank's record: call once the network is connected (every rank has published).
  static Topology read(KeyValueStore& store, int rank, int size);
  // From every rank's host identity (hostIdentity(), gathered by a group of another backend):
  // hosts only, one machine per rank and no RDMA facts.
  static Topology ofHosts(const std::vector<std::string>& identities, int rank);
  // `hostOf[r]`: the host of rank r, hosts numbered in order of their lowest rank;
  // `onThisMachine`: the ranks that share this rank's machine (this one included);
  // `firstWithoutRdma`: the lowest rank with no RDMA device, -1 for none.
  Topology(std::vector<int> hostOf, int rank, int onThisMachine, int firstWithoutRdma);

  int hosts() const { return int(members_.size()); }
  // The ranks of this rank's host, ascending (this one included).
  const std::vector<int>& hostRanks() const { return members_[size_t(hostOf_[size_t(rank_)])]; }
  // The ranks at this rank's place (its local rank) on every host, one per host, by host.
  // Only for a uniform topology.
  std::vector<int> peersAcrossHosts() const;
  // The ranks of host `host` (0 <= host < hosts()), ascending.
  const std::vector<int>& ranksOfHost(int host) const { return members_.at(size_t(host)); }
  // Every host holds the same number of ranks.
  bool uniform() const;
  // Several hosts with the same number (> 1) of ranks each: where reducing inside each host
  // first pays (else a rank's shard would have no peer on some host, or nothing to share).
  bool suitsHierarchy() const { return hosts() > 1 && uniform() && hostRanks().size() > 1; }
  // The ranks whose processes share this machine's cores (host.h's machineIdentity), this one
  // included, whatever their host identities say.
  int ranksOnThisMachine() const { return onThisMachine_; }
  // Every rank's machine has an RDMA device: DDLCOMM_TRANSPORT=auto then connects with UCX.
  bool rdmaOnEveryRank() const { return firstWithoutRdma_ < 0; }
  // The lowest rank without an RDMA device, -1 when every rank has one.
  int firstRankWithoutRdma() const { return firstWithoutRdma_; }
  // "2 hosts x 2 ranks" or "3 hosts of 1, 2 and 1 ranks": for logs and errors.
  std::string describe() const;

 private:
  std::vector<int> hostOf_;
  std::vector<std::vector<int>> members_;  // by host
  int rank_;
  int onThisMachine_;
  int firstWithoutRdma_;
};

}  // namespace ddlcomm
