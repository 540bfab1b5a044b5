// The plan of the compressed collectives (docs/design.md, "Algorithms"): how a vector splits
// into pieces and chunks, which chunks a rank reduces over one or two levels of hosts, the
// randomness stream of every encode, and the bytes each rank sends. The one implementation
// that runs it, over any process group's collectives, is csrc/torch/collective_compressed.cc;
// the statistics and the benchmarks take their sizes from here too.
#pragma once

#include <cstddef>
#include <utility>
#include <vector>

#include "collectives/collectives.h"
#include "compress/compress.h"
#include "transport/topology.h"

namespace ddlcomm {

// Quantizers and casts reduce the vector in pieces of kPieceElements elements (the last
// one shorter), each an independent scatter-reduce-gather over its own n chunks, so that one
// piece's all-gather overlaps the next piece's encode. Part of what the result is.
// Large, because each piece waits for the slowest rank; still more than one for a 100 MB
// gradient, so that pieces overlap.
constexpr size_t kPieceElements = size_t(1) << 24;

// Randomness stream of one encode: distinct per call stream, rank, phase (0 worker,
// 1 server), chunk and piece.
uint64_t encodeStream(uint64_t callStream, int rank, int phase, int chunk, int size, uint64_t piece);

// One piece of the vector: its first element, and its n chunks relative to it.
struct PieceSpan {
  size_t begin = 0;
  ring::Chunks chunks{0, 1};
};

// The pieces of `count` elements over `size` ranks, in order.
std::vector<PieceSpan> piecesOf(size_t count, int size);

// Length of the server residual of `rank`: its chunk of every piece, in piece order.
size_t serverResidualLength(size_t count, int rank, int size);

// The [begin, end) ranges whose sums `rank` re-encodes in a compressed all-reduce of `count`
// elements, in its server residual's order: the hierarchical plan over `topology`'s hosts
// where `layered`, else the flat one.
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

// Bytes a payload of `numel` elements takes where it travels: whole 4-byte words, which the
// CUDA decoders read in place.
size_t payloadSlot(const compress::Config& config, size_t numel);

// Payload bytes `rank` sends in one compressed all-reduce of `count` elements over a group's
// all-to-all and all-gather that send each rank's block once to each peer (frame headers not
// included): per piece, its slot of every other rank's chunk, then (n - 1) times the widest
// slot; for sparse formats (n - 1) times its slot.
size_t compressedAllreduceWireBytes(const compress::Config& config, size_t count, int rank, int size);

// Payload bytes every rank sends in one flat compressed reduce-scatter of `count` output elements.
size_t compressedReduceScatterWireBytes(const compress::Config& config, size_t count, int size);

}  // namespace ddlcomm
