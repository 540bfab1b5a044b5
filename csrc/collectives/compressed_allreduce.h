// Compressed all-reduce with error feedback (docs/design.md, "Algorithms"). Every
// rank ends with bitwise identical results, because everything a rank decodes is bytes
// that every other rank decodes too, summed in rank order.
#pragma once

#include <cstddef>
#include <utility>
#include <vector>

#include "collectives/collectives.h"
#include "collectives/communicator.h"
#include "compress/compress.h"

namespace ddlcomm {

struct CompressedAllreduceArgs {
  compress::Config config;
  DataType dtype = DataType::Float32;  // of `data`: float32, float16 or bfloat16
  void* data = nullptr;                // in: this rank's vector; out: the reduced vector
  size_t count = 0;
  float* workerResidual = nullptr;  // float32[count], or null for no error feedback
  float* serverResidual = nullptr;  // float32[serverResidualLength(...)], or null
  bool average = true;              // divide the sum by the number of ranks
  uint64_t stream = 0;              // randomness stream of this call (e.g. the training step)
  bool flat = false;                // one level even where the group takes two (the adaptive hooks' choice)
};

// Quantizers and casts reduce the vector in pieces of kPieceElements elements (the last
// one shorter), each an independent scatter-reduce-gather over its own n chunks, so that one
// piece's all-gather overlaps the next piece's encode. Part of what the result is: the
// collectives path (csrc/torch/collective_compressed.cc) takes its split from piecesOf.
// Large, because each piece waits for the slowest rank; still more than one for a 100 MB
// gradient, so that pieces overlap (measured in
// docs/results/README.md, "Compressed all-reduce choices").
constexpr size_t kPieceElements = size_t(1) << 24;

// Randomness stream of one encode: distinct per call stream, rank, phase (0 worker,
// 1 server), chunk and piece. The collectives path of CUDA tensors calls this one.
uint64_t encodeStream(uint64_t callStream, int rank, int phase, int chunk, int size, uint64_t piece);

// One piece of the vector: its first element, and its n chunks relative to it.
struct PieceSpan {
  size_t begin = 0;
  ring::Chunks chunks{0, 1};
};

// The pieces of `count` elements over `size` ranks, in order. The one layout: the native
// algorithm, the collectives path and the statistics (through _C) all take it from here.
std::vector<PieceSpan> piecesOf(size_t count, int size);

// Length of the server residual of `rank`: its chunk of every piece, in piece order.
size_t serverResidualLength(size_t count, int rank, int size);

// Whether compressed all-reduces on `comm` take two levels (exact inside each host, compressed
// across) unless a call asks for one (CompressedAllreduceArgs::flat): where layeredByHost.
bool compressedTwoLevels(const Communicator& comm);

// The [begin, end) ranges whose sums this rank re-encodes in a compressed all-reduce of
// `count` elements on `comm` (the flat plan, or the hierarchical one where `comm` takes it for
// `config` and the call is not `flat`), in its server residual's order.
std::vector<std::pair<size_t, size_t>> serverChunks(const Communicator& comm, const compress::Config& config,
                                                    size_t count, bool flat = false);

// The same for a plan given by its hosts: the hierarchical one where `layered`, else the flat one.
std::vector<std::pair<size_t, size_t>> serverChunks(const Topology& topology, bool layered, size_t count, int rank,
                                                    int size);
// The flat plan's: chunk `rank` of every piece.
std::vector<std::pair<size_t, size_t>> flatServerChunks(size_t count, int rank, int size);

// The hierarchical plan: every rank's chunk of a piece keeps its length in the flat plan (so
// does its server residual), but the chunks are placed so that those of the ranks at one place
// on every host (one across-hosts ring) lie together, as the shard their local rank reduces
// inside its host. Per piece: its split among the host's ranks (relative to the piece), and
// this rank's shard as a piece of the across-hosts ring (absolute, one chunk per host).
struct HostPlan {
  std::vector<ring::Chunks> inHost;
  std::vector<PieceSpan> across;
};
HostPlan hostPlanOf(const Topology& topology, size_t count, int rank, int size);

// Payload bytes `rank` sends in one compressed all-reduce of `count` elements (frame
// headers not included), from the same plan the algorithm sizes its messages with.
size_t compressedAllreduceWireBytes(const compress::Config& config, size_t count, int rank, int size);

// Quantizers and casts (1-bit, ternary, fp16, bf16), per piece: each rank encodes the
// piece in n chunks with the worker residual; all-to-all sends chunk i to rank i, which
// decodes and sums the n payloads in rank order, re-encodes the sum with its server residual;
// an all-gather of those payloads gives every rank the same bytes to decode.
// Sparse formats (top-k, random-k): all-gather of every rank's (index, value) payload,
// decoded and summed in rank order. Over hosts (compressedTwoLevels, unless `flat`) both are
// exact inside each host: its ranks reduce-scatter, each compresses its shard of the host sum
// with the ranks at its place on the other hosts, and they all-gather the result inside the host.
void compressedAllreduce(Communicator& comm, const CompressedAllreduceArgs& args);

}  // namespace ddlcomm
