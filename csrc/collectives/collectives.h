// The collective algorithms, over a Communicator. Buffers are raw, contiguous and owned by
// the caller; counts are in elements of `dtype`. Every function is one collective call.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "collectives/communicator.h"

namespace ddlcomm {

// In place. Ring (reduce-scatter + all-gather) for large buffers, recursive doubling for
// small ones; on a group over several hosts with several ranks each (Topology), hierarchical:
// reduce-scatter inside each host, an all-reduce of each rank's shard across the hosts (one
// per local rank, so every rank's link carries its share: halving-doubling over a power of
// two of 8 or more hosts and shards up to DDLCOMM_HALVING_DOUBLING_BYTES, else a ring; one
// rank per host: the same rule for the whole buffer), all-gather inside the host. Every rank
// ends with bitwise identical results.
void allreduce(Communicator& comm, void* data, size_t count, DataType dtype, ReduceOp op);

// In place from `root`: binomial tree for small buffers, pipelined chain for large ones.
void broadcast(Communicator& comm, void* data, size_t count, DataType dtype, int root);

// `root` receives op(all inputs) in `output`; `input` is never modified.
void reduce(Communicator& comm, const void* input, void* output, size_t count, DataType dtype, ReduceOp op,
            int root);

// output = concat(input of rank 0, ..., rank n-1); `count` is per rank. input may alias
// output's slot for this rank.
void allgather(Communicator& comm, const void* input, void* output, size_t count, DataType dtype);

// output (count elements) = op over ranks of their input block `rank` (input has n*count).
void reduceScatter(Communicator& comm, const void* input, void* output, size_t count, DataType dtype, ReduceOp op);

// Block i of `input` (sendCounts[i] elements) goes to rank i; block j of `output`
// (recvCounts[j] elements) comes from rank j.
void allToAll(Communicator& comm, const void* input, const std::vector<size_t>& sendCounts, void* output,
              const std::vector<size_t>& recvCounts, DataType dtype);

// `root` receives every rank's `count` elements into `output` (n*count); others pass null.
void gather(Communicator& comm, const void* input, void* output, size_t count, DataType dtype, int root);
// Rank i receives block i of root's `input` (n*count) into `output`.
void scatter(Communicator& comm, const void* input, void* output, size_t count, DataType dtype, int root);

void barrier(Communicator& comm);

// Whether the collectives that work in two levels (exact inside hosts, compressed across: the
// compressed all-reduce and reduce-scatter) do: forced by allreduce_algorithm=hierarchical, or
// by auto where the topology suits it (several hosts of the same number of ranks, 2 or more).
// The second form decides for a group of another backend (the collectives path of ddlcomm.compressed).
bool layeredByHost(const Communicator& comm);
bool layeredByHost(AllreduceAlgorithm algorithm, const Topology& topology);

namespace ring {
// Splits `total` elements into n nearly equal chunks, or at the n + 1 given `bounds`; chunk i
// is [begin(i), begin(i+1)).
struct Chunks {
  size_t total;
  int n;
  std::vector<size_t> bounds = {};
  size_t begin(int i) const { return bounds.empty() ? total * size_t(i) / size_t(n) : bounds[size_t(i)]; }
  size_t length(int i) const { return begin(i + 1) - begin(i); }
};
// The ranks a ring passes through, in order, and this rank's place among them: the whole
// group, or a part of it (a host's ranks, one rank per host).
struct Members {
  std::vector<int> ranks;
  int self;
  static Members all(const Communicator& comm);
  // `ranks` holds `rank`.
  static Members of(std::vector<int> ranks, int rank);
  int n() const { return int(ranks.size()); }
};
// After the call, chunk `self` of `data` holds the reduction over the members.
void reduceScatterInPlace(Call& call, char* data, const Chunks& chunks, DataType dtype, ReduceOp op,
                          const Members& members);
void reduceScatterInPlace(Call& call, char* data, const Chunks& chunks, DataType dtype, ReduceOp op);
// Before the call chunk `self` is this rank's; after it every chunk is filled.
void allgatherInPlace(Call& call, char* data, const Chunks& chunks, DataType dtype, const Members& members);
void allgatherInPlace(Call& call, char* data, const Chunks& chunks, DataType dtype);
}  // namespace ring

namespace halving {
// Recursive halving and doubling among `members` (halving_doubling.cc): with p = owners(n),
// the largest power of two <= n, members 0..p-1 end the reduce-scatter owning chunk `self` of
// `chunks` (whose n must be p) reduced over all members; members p.. fold into member
// self - p and own none (it returns false for them). The all-gather then fills every chunk
// on every member.
int owners(int members);
bool reduceScatterInPlace(Call& call, char* data, const ring::Chunks& chunks, DataType dtype, ReduceOp op,
                          const ring::Members& members);
void allgatherInPlace(Call& call, char* data, const ring::Chunks& chunks, DataType dtype,
                      const ring::Members& members);
}  // namespace halving

namespace shared {
// Collectives through the windows of a shared-memory group (shared_windows.cc).
void allreduceInWindows(Call& call, SharedWindows& windows, char* data, size_t count, DataType dtype, ReduceOp op);
// Whether a fill holds one element of every rank (the reduce-scatter's; the others need less).
bool windowsFit(const SharedWindows& windows, int n, DataType dtype);
// `output` (count elements) = the reduction of chunk `rank` of every rank's `input` (n * count).
void reduceScatterInWindows(Call& call, SharedWindows& windows, const char* input, char* output, size_t count,
                            DataType dtype, ReduceOp op);
// `output` (n * count elements) = every rank's `input` (count), in rank order; `input` may be
// this rank's place in `output`.
void allgatherInWindows(Call& call, SharedWindows& windows, const char* input, char* output, size_t count,
                        DataType dtype);
}  // namespace shared

}  // namespace ddlcomm
