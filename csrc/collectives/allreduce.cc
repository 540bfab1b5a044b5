#include <cstring>

#include "collectives/collectives.h"
#include "reduce/reduce.h"

namespace ddlcomm {
namespace {

// Recursive doubling, with the ranks beyond the largest power of two folded in first.
// Partners combine op(a, b) and op(b, a), which are bitwise equal for every supported op,
// so all ranks end with the same bits.
void recursiveDoubling(Call& call, char* data, size_t count, DataType dtype, ReduceOp op) {
  const int n = call.comm().size(), r = call.comm().rank();
  const size_t bytes = count * elementSize(dtype);
  int p2 = 1;
  while (p2 * 2 <= n) p2 *= 2;
  char* incoming = call.comm().scratch(bytes, 0);
  Request send, recv;

  if (r >= p2) {  // folded rank: hand the data to a partner, get the result back
    call.send(send, r - p2, data, bytes);
    call.recv(recv, r - p2, data, bytes);
    call.wait(send);
    call.wait(recv);
    return;
  }
  if (r + p2 < n) {
    call.recv(recv, r + p2, incoming, bytes);
    call.wait(recv);
    reduceInto(op, dtype, data, incoming, count);
  }
  for (int mask = 1; mask < p2; mask <<= 1) {
    const int partner = r ^ mask;
    call.recv(recv, partner, incoming, bytes);
    call.send(send, partner, data, bytes);
    call.wait(send);
    call.wait(recv);
    reduceInto(op, dtype, data, incoming, count);
  }
  if (op == ReduceOp::Avg) divideBy(dtype, data, count, double(n));
  if (r + p2 < n) {
    call.send(send, r + p2, data, bytes);
    call.wait(send);
  }
}

// An all-reduce among `members` of this group, AVG dividing by `divisor`: a reduce-scatter,
// the owner of each chunk divides it once (so AVG is identical on every rank), an all-gather.
void allreduceAmong(Call& call, char* data, size_t count, DataType dtype, ReduceOp op, const ring::Members& members,
                    bool halvingDoubling, double divisor) {
  const size_t es = elementSize(dtype);
  if (halvingDoubling) {
    const ring::Chunks chunks{count, halving::owners(members.n())};
    const bool owner = halving::reduceScatterInPlace(call, data, chunks, dtype, op, members);
    if (op == ReduceOp::Avg && owner) {
      divideBy(dtype, data + chunks.begin(members.self) * es, chunks.length(members.self), divisor);
    }
    halving::allgatherInPlace(call, data, chunks, dtype, members);
    return;
  }
  const ring::Chunks chunks{count, members.n()};
  ring::reduceScatterInPlace(call, data, chunks, dtype, op, members);
  if (op == ReduceOp::Avg) divideBy(dtype, data + chunks.begin(members.self) * es, chunks.length(members.self), divisor);
  ring::allgatherInPlace(call, data, chunks, dtype, members);
}

// Across hosts, halving-doubling takes 2 log2 h steps where the ring takes 2(h-1), for the same
// bytes, over a power of two of hosts (elsewhere its folding costs a partner's whole buffer
// twice). Measured on emulated links (docs/collectives.md), it wins where steps cost more
// than bytes, from 8 hosts and for shards up to about 1 MiB; over 4 hosts it was as often
// slower as faster, and on large shards slower: each of its steps starts a flow on another
// connection, where the ring keeps one flow per link going (DDLCOMM_HALVING_DOUBLING_BYTES).
bool halvingDoublingSuits(const Communicator& comm, int hosts, size_t shardBytes) {
  return hosts >= 8 && halving::owners(hosts) == hosts && shardBytes <= comm.options().halvingDoublingBytes;
}

// Reduce-scatter inside the host, an all-reduce of this rank's shard with the ranks at its
// place on the other hosts, all-gather inside the host: each host's link carries 2(h-1)/h of
// the buffer over h hosts where a flat ring puts 2(n-1)/n on it, and every rank drives its own
// shard across. Each element is reduced by one rank and copied to the others, so every rank
// ends with the same bits.
void hierarchicalAllreduce(Call& call, char* data, size_t count, DataType dtype, ReduceOp op) {
  const Topology& topology = call.comm().topology();
  const int r = call.comm().rank();
  const ring::Members host = ring::Members::of(topology.hostRanks(), r);
  const ring::Members across = ring::Members::of(topology.peersAcrossHosts(), r);
  const ring::Chunks inHost{count, host.n()};
  ring::reduceScatterInPlace(call, data, inHost, dtype, op, host);
  char* shard = data + inHost.begin(host.self) * elementSize(dtype);
  const size_t shardCount = inHost.length(host.self);
  allreduceAmong(call, shard, shardCount, dtype, op, across,
                 halvingDoublingSuits(call.comm(), across.n(), shardCount * elementSize(dtype)),
                 double(call.comm().size()));
  ring::allgatherInPlace(call, data, inHost, dtype, host);
}

// The two-level layout of a buffer of one chunk per rank: by the place of the chunk's rank on
// its host, then by host, so that the chunks of the ranks at one place (one across-hosts ring)
// lie together. Calls visit(slot, owner) for every rank.
template <class Visit>
void forEachSlot(const Topology& topology, Visit visit) {
  const size_t hosts = size_t(topology.hosts()), places = topology.hostRanks().size();
  for (size_t place = 0; place < places; ++place) {
    for (size_t h = 0; h < hosts; ++h) visit(place * hosts + h, size_t(topology.ranksOfHost(int(h))[place]));
  }
}

// In the two-level layout, a ring reduce-scatter among the host's ranks leaves local rank l the
// host's reductions of the chunks of the ranks at place l on every host, in host order, and a
// ring reduce-scatter of those with the ranks at place l on the other hosts leaves each its
// own. A host's link carries (h-1)/h of its ranks' share where a flat ring puts (n-1)/n of the
// buffer on it. Returns where this rank's reduced chunk is in `work` (count * n elements).
char* hierarchicalReduceScatter(Call& call, const char* input, char* work, size_t count, DataType dtype,
                                ReduceOp op) {
  const Topology& topology = call.comm().topology();
  const ring::Members host = ring::Members::of(topology.hostRanks(), call.comm().rank());
  const ring::Members across = ring::Members::of(topology.peersAcrossHosts(), call.comm().rank());
  const size_t chunkBytes = count * elementSize(dtype), hosts = size_t(across.n());
  forEachSlot(topology, [&](size_t slot, size_t owner) {
    std::memcpy(work + slot * chunkBytes, input + owner * chunkBytes, chunkBytes);
  });
  ring::reduceScatterInPlace(call, work, ring::Chunks{count * size_t(call.comm().size()), host.n()}, dtype, op, host);
  char* block = work + size_t(host.self) * hosts * chunkBytes;
  ring::reduceScatterInPlace(call, block, ring::Chunks{hosts * count, across.n()}, dtype, op, across);
  return block + size_t(across.self) * chunkBytes;
}

// The reverse: an all-gather among the ranks at this rank's place on every host, then of those
// blocks inside the host, then out of the two-level layout into rank order.
void hierarchicalAllgather(Call& call, const char* input, char* output, char* work, size_t count, DataType dtype) {
  const Topology& topology = call.comm().topology();
  const ring::Members host = ring::Members::of(topology.hostRanks(), call.comm().rank());
  const ring::Members across = ring::Members::of(topology.peersAcrossHosts(), call.comm().rank());
  const size_t chunkBytes = count * elementSize(dtype), hosts = size_t(across.n());
  char* block = work + size_t(host.self) * hosts * chunkBytes;
  std::memcpy(block + size_t(across.self) * chunkBytes, input, chunkBytes);
  ring::allgatherInPlace(call, block, ring::Chunks{hosts * count, across.n()}, dtype, across);
  ring::allgatherInPlace(call, work, ring::Chunks{count * size_t(call.comm().size()), host.n()}, dtype, host);
  forEachSlot(topology, [&](size_t slot, size_t owner) {
    std::memcpy(output + owner * chunkBytes, work + slot * chunkBytes, chunkBytes);
  });
}

// The shared-memory windows (every rank of the group on this host), where the algorithm is
// ddlcomm's to choose; else null.
SharedWindows* windowsOf(Communicator& comm) {
  return comm.options().allreduceAlgorithm == AllreduceAlgorithm::Auto ? comm.transport().sharedWindows() : nullptr;
}

}  // namespace

bool layeredByHost(AllreduceAlgorithm algorithm, const Topology& topology) {
  return algorithm == AllreduceAlgorithm::Hierarchical ||
         (algorithm == AllreduceAlgorithm::Auto && topology.suitsHierarchy());
}

bool layeredByHost(const Communicator& comm) {
  return layeredByHost(comm.options().allreduceAlgorithm, comm.topology());
}

void allreduce(Communicator& comm, void* data, size_t count, DataType dtype, ReduceOp op) {
  checkReduceOpSupported(op, dtype);
  comm.run(OpCode::Allreduce, dtype, count, [&](Call& call) {
    if (comm.size() == 1 || count == 0) return;
    AllreduceAlgorithm algo = comm.options().allreduceAlgorithm;
    if (SharedWindows* windows = windowsOf(comm)) {
      ++comm.counters().sharedMemoryAllreduces;
      shared::allreduceInWindows(call, *windows, static_cast<char*>(data), count, dtype, op);
      return;
    }
    if (algo == AllreduceAlgorithm::Auto) {
      const bool small = count * elementSize(dtype) <= comm.options().smallMessageBytes;
      // The ring needs at least one element per chunk to be worth its 2(n-1) steps.
      // One rank per host: the whole buffer crosses hosts, by the same rule as a shard.
      const bool acrossHosts = comm.topology().hosts() == comm.size();
      algo = (small || count < size_t(comm.size())) ? AllreduceAlgorithm::RecursiveDoubling
             : comm.topology().suitsHierarchy()             ? AllreduceAlgorithm::Hierarchical
             : acrossHosts && halvingDoublingSuits(comm, comm.size(), count * elementSize(dtype))
                 ? AllreduceAlgorithm::HalvingDoubling
                 : AllreduceAlgorithm::Ring;
    }
    char* bytes = static_cast<char*>(data);
    if (algo == AllreduceAlgorithm::Hierarchical) {
      ++comm.counters().hierarchicalAllreduces;
      hierarchicalAllreduce(call, bytes, count, dtype, op);
    } else if (algo == AllreduceAlgorithm::Ring || algo == AllreduceAlgorithm::HalvingDoubling) {
      const bool halvingDoubling = algo == AllreduceAlgorithm::HalvingDoubling;
      ++(halvingDoubling ? comm.counters().halvingDoublingAllreduces : comm.counters().ringAllreduces);
      allreduceAmong(call, bytes, count, dtype, op, ring::Members::all(comm), halvingDoubling, double(comm.size()));
    } else {
      ++comm.counters().recursiveDoublingAllreduces;
      recursiveDoubling(call, static_cast<char*>(data), count, dtype, op);
    }
  });
}

void barrier(Communicator& comm) {
  uint8_t token = 0;
  comm.run(OpCode::Barrier, DataType::UInt8, 1, [&](Call& call) {
    if (comm.size() > 1) recursiveDoubling(call, reinterpret_cast<char*>(&token), 1, DataType::UInt8, ReduceOp::Max);
  });
}

void reduce(Communicator& comm, const void* input, void* output, size_t count, DataType dtype, ReduceOp op,
            int root) {
  checkReduceOpSupported(op, dtype);
  const size_t es = elementSize(dtype);
  comm.run(OpCode::Reduce, dtype, count, [&](Call& call) {
    const int n = comm.size(), r = comm.rank();
    if (n == 1 || count == 0) {
      if (output != input && count) std::memcpy(output, input, count * es);
      return;
    }
    // Reduce-scatter on a private copy, then every rank sends its reduced chunk to root.
    char* work = comm.scratch(count * es, 1);
    std::memcpy(work, input, count * es);
    const ring::Chunks chunks{count, n};
    ring::reduceScatterInPlace(call, work, chunks, dtype, op);
    if (op == ReduceOp::Avg) divideBy(dtype, work + chunks.begin(r) * es, chunks.length(r), double(n));
    if (r != root) {
      Request send;
      call.send(send, root, work + chunks.begin(r) * es, chunks.length(r) * es);
      call.wait(send);
      return;
    }
    char* out = static_cast<char*>(output);
    std::vector<Request> recvs(static_cast<size_t>(n));
    for (int peer = 0; peer < n; ++peer) {
      if (peer == r) continue;
      call.recv(recvs[size_t(peer)], peer, out + chunks.begin(peer) * es, chunks.length(peer) * es);
    }
    std::memcpy(out + chunks.begin(r) * es, work + chunks.begin(r) * es, chunks.length(r) * es);
    for (int peer = 0; peer < n; ++peer) {
      if (peer != r) call.wait(recvs[size_t(peer)]);
    }
  });
}

void reduceScatter(Communicator& comm, const void* input, void* output, size_t count, DataType dtype,
                   ReduceOp op) {
  checkReduceOpSupported(op, dtype);
  const size_t es = elementSize(dtype);
  comm.run(OpCode::ReduceScatter, dtype, count, [&](Call& call) {
    const int n = comm.size(), r = comm.rank();
    const size_t total = count * size_t(n);
    if (count == 0) return;
    if (n == 1) {
      if (output != input) std::memcpy(output, input, count * es);
      return;
    }
    SharedWindows* windows = windowsOf(comm);
    if (windows && shared::windowsFit(*windows, n, dtype)) {
      ++comm.counters().sharedMemoryReduceScatters;
      shared::reduceScatterInWindows(call, *windows, static_cast<const char*>(input), static_cast<char*>(output),
                                     count, dtype, op);
      return;
    }
    char* work = comm.scratch(total * es, 1);
    char* mine = work + size_t(r) * count * es;
    if (layeredByHost(comm)) {
      ++comm.counters().hierarchicalReduceScatters;
      mine = hierarchicalReduceScatter(call, static_cast<const char*>(input), work, count, dtype, op);
    } else {
      std::memcpy(work, input, total * es);
      ring::reduceScatterInPlace(call, work, ring::Chunks{total, n}, dtype, op);
    }
    if (op == ReduceOp::Avg) divideBy(dtype, mine, count, double(n));
    std::memcpy(output, mine, count * es);
  });
}

void allgather(Communicator& comm, const void* input, void* output, size_t count, DataType dtype) {
  const size_t es = elementSize(dtype);
  comm.run(OpCode::Allgather, dtype, count, [&](Call& call) {
    const int n = comm.size(), r = comm.rank();
    char* out = static_cast<char*>(output);
    if (count == 0) return;
    SharedWindows* windows = windowsOf(comm);
    if (windows && n > 1) {
      ++comm.counters().sharedMemoryAllgathers;
      shared::allgatherInWindows(call, *windows, static_cast<const char*>(input), out, count, dtype);
      return;
    }
    if (layeredByHost(comm)) {
      ++comm.counters().hierarchicalAllgathers;
      hierarchicalAllgather(call, static_cast<const char*>(input), out, comm.scratch(size_t(n) * count * es, 1), count,
                            dtype);
      return;
    }
    char* mine = out + size_t(r) * count * es;
    if (mine != input) std::memmove(mine, input, count * es);
    ring::allgatherInPlace(call, out, ring::Chunks{count * size_t(n), n}, dtype);
  });
}

}  // namespace ddlcomm
