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

void ringAllreduce(Call& call, char* data, size_t count, DataType dtype, ReduceOp op) {
  const int n = call.comm().size(), r = call.comm().rank();
  const ring::Chunks chunks{count, n};
  ring::reduceScatterInPlace(call, data, chunks, dtype, op);
  // Dividing only the owned chunk, once, keeps AVG identical on every rank.
  if (op == ReduceOp::Avg) {
    divideBy(dtype, data + chunks.begin(r) * elementSize(dtype), chunks.length(r), double(n));
  }
  ring::allgatherInPlace(call, data, chunks, dtype);
}

// Reduce-scatter inside the host, an all-reduce of this rank's shard with the ranks at its
// place on the other hosts, all-gather inside the host: each host's link carries 2(h-1)/h of
// the buffer over h hosts where a flat ring puts 2(n-1)/n on it, and every rank drives its own
// shard across. Each element is reduced by one rank and copied to the others, so every rank
// ends with the same bits.
void hierarchicalAllreduce(Call& call, char* data, size_t count, DataType dtype, ReduceOp op) {
  const Topology& topology = call.comm().topology();
  const int r = call.comm().rank();
  const size_t es = elementSize(dtype);
  const ring::Members host = ring::Members::of(topology.hostRanks(), r);
  const ring::Members across = ring::Members::of(topology.peersAcrossHosts(), r);
  const ring::Chunks inHost{count, host.n()};
  ring::reduceScatterInPlace(call, data, inHost, dtype, op, host);
  char* shard = data + inHost.begin(host.self) * es;
  const ring::Chunks acrossHosts{inHost.length(host.self), across.n()};
  ring::reduceScatterInPlace(call, shard, acrossHosts, dtype, op, across);
  if (op == ReduceOp::Avg) {
    divideBy(dtype, shard + acrossHosts.begin(across.self) * es, acrossHosts.length(across.self),
             double(call.comm().size()));
  }
  ring::allgatherInPlace(call, shard, acrossHosts, dtype, across);
  ring::allgatherInPlace(call, data, inHost, dtype, host);
}

}  // namespace

void allreduce(Communicator& comm, void* data, size_t count, DataType dtype, ReduceOp op) {
  checkReduceOpSupported(op, dtype);
  comm.run(OpCode::Allreduce, dtype, count, [&](Call& call) {
    if (comm.size() == 1 || count == 0) return;
    AllreduceAlgorithm algo = comm.options().allreduceAlgorithm;
    SharedWindows* windows = comm.transport().sharedWindows();
    if (algo == AllreduceAlgorithm::Auto && windows) {
      ++comm.counters().sharedMemoryAllreduces;
      shared::allreduceInWindows(call, *windows, static_cast<char*>(data), count, dtype, op);
      return;
    }
    if (algo == AllreduceAlgorithm::Auto) {
      const bool small = count * elementSize(dtype) <= comm.options().smallMessageBytes;
      // The ring needs at least one element per chunk to be worth its 2(n-1) steps.
      algo = (small || count < size_t(comm.size())) ? AllreduceAlgorithm::RecursiveDoubling
             : comm.topology().suitsHierarchy()             ? AllreduceAlgorithm::Hierarchical
                                                            : AllreduceAlgorithm::Ring;
    }
    if (algo == AllreduceAlgorithm::Hierarchical) {
      ++comm.counters().hierarchicalAllreduces;
      hierarchicalAllreduce(call, static_cast<char*>(data), count, dtype, op);
    } else if (algo == AllreduceAlgorithm::Ring) {
      ++comm.counters().ringAllreduces;
      ringAllreduce(call, static_cast<char*>(data), count, dtype, op);
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
    char* work = comm.scratch(total * es, 1);
    std::memcpy(work, input, total * es);
    ring::reduceScatterInPlace(call, work, ring::Chunks{total, n}, dtype, op);
    if (op == ReduceOp::Avg) divideBy(dtype, work + size_t(r) * count * es, count, double(n));
    std::memcpy(output, work + size_t(r) * count * es, count * es);
  });
}

void allgather(Communicator& comm, const void* input, void* output, size_t count, DataType dtype) {
  const size_t es = elementSize(dtype);
  comm.run(OpCode::Allgather, dtype, count, [&](Call& call) {
    const int n = comm.size(), r = comm.rank();
    char* out = static_cast<char*>(output);
    char* mine = out + size_t(r) * count * es;
    if (count && mine != input) std::memmove(mine, input, count * es);
    if (count) ring::allgatherInPlace(call, out, ring::Chunks{count * size_t(n), n}, dtype);
  });
}

}  // namespace ddlcomm
