#include "collectives/compressed_plan.h"

#include <algorithm>

namespace ddlcomm {

uint64_t encodeStream(uint64_t callStream, int rank, int phase, int chunk, int size, uint64_t piece) {
  // Piece 0 keeps the streams of a one-piece call; an odd multiplier spreads the others
  // far from every stream a small call stream, rank and chunk give.
  const uint64_t base =
      ((callStream * 2 + uint64_t(phase)) * uint64_t(size) + uint64_t(rank)) * uint64_t(size) + uint64_t(chunk);
  return base + piece * 0x9e3779b97f4a7c15ull;
}

std::vector<PieceSpan> piecesOf(size_t count, int size) {
  std::vector<PieceSpan> spans;
  for (size_t begin = 0; begin < count; begin += kPieceElements) {
    spans.push_back({begin, ring::Chunks{std::min(kPieceElements, count - begin), size}});
  }
  return spans;
}

size_t serverResidualLength(size_t count, int rank, int size) {
  size_t length = 0;
  for (const PieceSpan& span : piecesOf(count, size)) length += span.chunks.length(rank);
  return length;
}

HostPlan hostPlanOf(const Topology& topology, size_t count, int rank, int size) {
  const size_t local = size_t(std::find(topology.hostRanks().begin(), topology.hostRanks().end(), rank) -
                              topology.hostRanks().begin());
  const size_t perHost = topology.hostRanks().size();
  HostPlan plan;
  for (const PieceSpan& flat : piecesOf(count, size)) {
    ring::Chunks& inHost = plan.inHost.emplace_back(ring::Chunks{flat.chunks.total, int(perHost), {0}});
    std::vector<size_t> across{0};
    for (size_t l = 0; l < perHost; ++l) {
      size_t shard = 0;
      for (int h = 0; h < topology.hosts(); ++h) {
        shard += flat.chunks.length(topology.ranksOfHost(h)[l]);
        if (l == local) across.push_back(shard);
      }
      inHost.bounds.push_back(inHost.bounds.back() + shard);
    }
    plan.across.push_back({flat.begin + inHost.begin(int(local)),
                           ring::Chunks{across.back(), topology.hosts(), std::move(across)}});
  }
  return plan;
}

namespace {

// Chunk `self` of every span, as absolute ranges.
std::vector<std::pair<size_t, size_t>> chunksAt(const std::vector<PieceSpan>& spans, int self) {
  std::vector<std::pair<size_t, size_t>> chunks;
  for (const PieceSpan& span : spans) {
    chunks.emplace_back(span.begin + span.chunks.begin(self), span.begin + span.chunks.begin(self + 1));
  }
  return chunks;
}

}  // namespace

std::vector<std::pair<size_t, size_t>> serverChunks(const Topology& topology, bool layered, size_t count, int r,
                                                    int n) {
  if (!layered) return flatServerChunks(count, r, n);
  return chunksAt(hostPlanOf(topology, count, r, n).across, ring::Members::of(topology.peersAcrossHosts(), r).self);
}

std::vector<std::pair<size_t, size_t>> flatServerChunks(size_t count, int rank, int size) {
  return chunksAt(piecesOf(count, size), rank);
}

size_t payloadSlot(const compress::Config& config, size_t numel) {
  return (compress::encodedBytes(config, numel) + 3) / 4 * 4;
}

size_t compressedAllreduceWireBytes(const compress::Config& config, size_t count, int rank, int size) {
  if (count == 0 || size == 1) return 0;
  if (compress::isSparse(config.format)) return size_t(size - 1) * payloadSlot(config, count);
  size_t total = 0;
  for (const PieceSpan& piece : piecesOf(count, size)) {
    size_t widest = 0;
    for (int i = 0; i < size; ++i) {
      const size_t slot = payloadSlot(config, piece.chunks.length(i));
      if (i != rank) total += slot;
      widest = std::max(widest, slot);
    }
    total += size_t(size - 1) * widest;
  }
  return total;
}

size_t compressedReduceScatterWireBytes(const compress::Config& config, size_t count, int size) {
  return count == 0 ? 0 : size_t(size - 1) * payloadSlot(config, count);
}

}  // namespace ddlcomm
