// A communicator: one group's transport plus what every collective needs around it:
// sequence numbers, deadlines, scratch memory, and the failure policy (record the cause
// in the store for the other ranks (failure_report.h), abort the transport, throw).
#pragma once

#include <atomic>
#include <chrono>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "collectives/failure_report.h"
#include "common/dtype.h"
#include "transport/store.h"
#include "transport/topology.h"
#include "transport/transport.h"

namespace ddlcomm {

enum class AllreduceAlgorithm { Auto, Ring, RecursiveDoubling, HalvingDoubling, Hierarchical };

// "auto", "ring", "recursive_doubling" (or "rd"), "halving_doubling" or "hierarchical"; InvalidArgument naming
// `what` (the setting it came from) otherwise.
AllreduceAlgorithm allreduceAlgorithmNamed(const std::string& name, const std::string& what);

struct CollectiveOptions {
  std::chrono::milliseconds timeout{std::chrono::minutes(30)};
  // At or below this many bytes all-reduce uses recursive doubling (latency-bound regime).
  size_t smallMessageBytes = 64 * 1024;  // DDLCOMM_SMALL_MESSAGE_BYTES
  // At or below this many bytes of its shard (with one rank per host, of the buffer), an
  // all-reduce crosses a power of two (>= 8) of hosts by halving-doubling (2 log2 h steps);
  // above, by a ring (2(h-1) steps, whose one steady flow per link keeps TCP's window open).
  size_t halvingDoublingBytes = 1 << 20;  // DDLCOMM_HALVING_DOUBLING_BYTES
  // Ring pipelining granularity: a segment is reduced and forwarded while the next arrives.
  size_t segmentBytes = 512 * 1024;  // DDLCOMM_SEGMENT_BYTES
  // DDLCOMM_ALLREDUCE_ALGO, or the group's ddlcomm.Options(allreduce_algorithm=)
  AllreduceAlgorithm allreduceAlgorithm = AllreduceAlgorithm::Auto;
  // With shared-memory windows: at or below this, one synchronisation and every rank reduces all.
  size_t sharedOneShotBytes = 64 * 1024;  // DDLCOMM_SHM_ONESHOT_BYTES

  // The environment's settings; `algorithm`, the group's own choice, wins over
  // DDLCOMM_ALLREDUCE_ALGO (both are checked either way).
  static CollectiveOptions fromEnvironment(std::chrono::milliseconds timeout,
                                           const std::optional<std::string>& algorithm = std::nullopt);
};

// Counts of what this group's collectives did, for tests and diagnostics. Read and written on
// the executor thread only (like the rest of the Communicator).
struct CollectiveCounters {
  uint64_t ringAllreduces = 0;
  uint64_t recursiveDoublingAllreduces = 0;
  uint64_t halvingDoublingAllreduces = 0;  // flat: forced, or auto over one-rank hosts
  uint64_t sharedMemoryAllreduces = 0;
  uint64_t sharedMemoryReduceScatters = 0;
  uint64_t sharedMemoryAllgathers = 0;
  uint64_t hierarchicalAllreduces = 0;
  uint64_t hierarchicalReduceScatters = 0;
  uint64_t hierarchicalAllgathers = 0;
  uint64_t hierarchicalCompressedAllreduces = 0;  // exact inside hosts, compressed across
};

// A snapshot of a group's counters and of its transport's connections.
struct GroupStats {
  CollectiveCounters collectives;
  TransportStats transport;
  std::string topology;  // Topology::describe()
};

class Communicator;
class Call;

// One send and one receive per peer, posted together and awaited per peer, so that each
// message is used as soon as it arrives while the others are still on the wire. Owned by
// its Call: a step may throw with messages in flight, and the failure path aborts the
// transport (which fails every posted request) while the requests still exist.
class PeerExchange {
 public:
  explicit PeerExchange(Call& call);
  void send(int to, const void* data, size_t bytes);
  void recv(int from, void* data, size_t bytes);
  // Returns once the receive from `from` is complete (at once for none posted).
  void waitRecv(int from);
  void waitSends();

 private:
  Call& call_;
  std::vector<Request> sends_, recvs_;
};

// One collective invocation: its identity on the wire, its deadline, and per-peer message
// counters so both sides number their messages the same way without the algorithm's help.
class Call {
 public:
  Call(Communicator& comm, OpCode op, DataType dtype, uint64_t count);
  Communicator& comm() { return comm_; }
  Deadline deadline() const { return deadline_; }
  const Signature& signature() const { return base_; }

  void send(Request& request, int peer, const void* data, size_t bytes);
  void recv(Request& request, int peer, void* data, size_t bytes);
  void wait(Request& request);
  // A fresh exchange that lives as long as this call.
  PeerExchange& exchange();

 private:
  Communicator& comm_;
  Signature base_;
  Deadline deadline_;
  std::vector<uint32_t> sent_;
  std::vector<uint32_t> received_;
  std::deque<PeerExchange> exchanges_;  // a deque: references stay valid as it grows
};

class Communicator {
 public:
  Communicator(std::unique_ptr<Transport> transport, Topology topology, std::shared_ptr<KeyValueStore> store,
               CollectiveOptions options);
  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const { return transport_->rank(); }
  int size() const { return transport_->size(); }
  Transport& transport() { return *transport_; }
  const Topology& topology() const { return topology_; }
  const CollectiveOptions& options() const { return options_; }
  // The timeout of the operations that start after this call (executor thread).
  void setTimeout(std::chrono::milliseconds timeout) { options_.timeout = timeout; }

  // Runs `body` as the collective `op` (a fresh sequence number). Any failure aborts the
  // communicator: the cause goes into the store first, so ranks that only see a closed
  // socket can name the rank that really failed.
  template <typename Body>
  void run(OpCode op, DataType dtype, uint64_t count, Body&& body) {
    throwIfAborted();
    Call call(*this, op, dtype, count);
    try {
      body(call);
    } catch (const Error& e) {
      failed(e);
    }
  }

  // Same failure policy for work that is not a collective call (point-to-point).
  [[noreturn]] void failed(const Error& error);
  void throwIfAborted() const;
  uint64_t nextSequenceNumber() { return nextSeq_++; }

  // Reusable scratch buffers (slot 0, 1, ...), grown on demand, never shrunk.
  char* scratch(size_t bytes, int slot = 0);

  CollectiveCounters& counters() { return counters_; }
  GroupStats stats() const { return GroupStats{counters_, transport_->stats(), topology_.describe()}; }

 private:
  std::unique_ptr<Transport> transport_;
  Topology topology_;
  CollectiveOptions options_;
  FailureReport failures_;  // the transport's failure hook and probe
  std::atomic<uint64_t> nextSeq_{0};  // also the collectives entered, which failures_ publishes
  std::vector<std::vector<char>> scratch_;
  CollectiveCounters counters_;
};

}  // namespace ddlcomm
