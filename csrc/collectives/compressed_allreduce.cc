#include "collectives/compressed_allreduce.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "collectives/collectives.h"

namespace ddlcomm {
namespace {

// Checks that a peer's payload was made with this rank's compressor, then decodes it.
void checkedDecode(const CompressedAllreduceArgs& a, const uint8_t* payload, size_t bytes, DataType outType,
                   void* out, size_t count) {
  compress::checkPayloadConfig(payload, bytes, a.config);
  compress::decode(payload, bytes, outType, out, count);
}

// Sparse formats: every member encodes `count` elements at `data` (its worker residual at
// `residual`), the members all-gather the payloads, and each zeroes `data` and sums the
// payloads' entries into it in member order, scaled by `factor`.
void sparseAmong(Call& call, const CompressedAllreduceArgs& a, const ring::Members& members, char* data,
                 float* residual, size_t count, float factor) {
  Communicator& comm = call.comm();
  const int k = members.n();
  const size_t capacity = compress::encodedBytes(a.config, count);
  uint8_t* all = reinterpret_cast<uint8_t*>(comm.scratch(size_t(k) * capacity, 1));  // slot 0: the rings'
  uint8_t* mine = all + size_t(members.self) * capacity;
  const size_t written = compress::encode(a.config, a.dtype, data, residual, count,
                                          encodeStream(a.stream, comm.rank(), 0, 0, comm.size(), 0), mine, capacity);
  DDLCOMM_CHECK(written == capacity, ErrorKind::Protocol, "sparse payload of ", written, " bytes, expected ", capacity);

  // All-gather of the payloads; the output is zeroed while they travel, then the entries
  // they carry are summed (in member order) into it.
  PeerExchange& gather = call.exchange();
  for (int s = 1; s < k; ++s) {
    const int from = (members.self - s + k) % k, to = (members.self + s) % k;
    gather.recv(members.ranks[size_t(from)], all + size_t(from) * capacity, capacity);
    gather.send(members.ranks[size_t(to)], mine, capacity);
  }
  std::memset(data, 0, count * elementSize(a.dtype));  // +0 in float32, float16 and bfloat16
  std::vector<const uint8_t*> payloads(static_cast<size_t>(k));
  for (int j = 0; j < k; ++j) {
    gather.waitRecv(members.ranks[size_t(j)]);
    payloads[size_t(j)] = all + size_t(j) * capacity;
  }
  gather.waitSends();
  compress::sumSparse(a.config, payloads.data(), payloads.size(), capacity, count, factor, a.dtype, data);
}

// Over hosts: a ring reduce-scatter among the host's ranks (sums in the tensor's dtype), the
// sparse all-gather of this rank's shard of the host sum with the ranks at its place on the
// other hosts (its selection and error feedback on that shard), a ring all-gather inside the
// host. A host's link carries one shard's payload per rank instead of every rank's payload of
// the whole vector to every rank on the other hosts.
void hierarchicalSparse(Call& call, const CompressedAllreduceArgs& a) {
  const Topology& topology = call.comm().topology();
  const int r = call.comm().rank();
  const ring::Members host = ring::Members::of(topology.hostRanks(), r);
  const ring::Members across = ring::Members::of(topology.peersAcrossHosts(), r);
  const ring::Chunks shards{a.count, host.n()};
  char* data = static_cast<char*>(a.data);
  const size_t es = elementSize(a.dtype), begin = shards.begin(host.self);
  ring::reduceScatterInPlace(call, data, shards, a.dtype, ReduceOp::Sum, host);
  sparseAmong(call, a, across, data + begin * es, a.workerResidual ? a.workerResidual + begin : nullptr,
              shards.length(host.self), a.average ? 1.f / float(call.comm().size()) : 1.f);
  ring::allgatherInPlace(call, data, shards, a.dtype, host);
}

// One piece of the vector and where its payloads go in the scratch buffers.
struct Piece : PieceSpan {
  std::vector<size_t> payloadAt;  // n + 1 offsets of its chunk payloads in `outgoing` / `gathered`
  size_t incomingAt = 0;          // offset of its n worker payloads of this rank's chunk
  size_t residualAt = 0;          // offset of this rank's chunk in the server residual
  size_t bytes(int i) const { return payloadAt[size_t(i) + 1] - payloadAt[size_t(i)]; }
};

// Every piece with its payload offsets; the totals size the scratch buffers.
struct Plan {
  std::vector<Piece> pieces;
  size_t payloadTotal = 0, incomingTotal = 0, residualTotal = 0;
};

// `spans`: the pieces, each split over the n members; r: this rank's place among them.
Plan planOf(const compress::Config& config, const std::vector<PieceSpan>& spans, int r, int n) {
  Plan plan;
  for (const PieceSpan& span : spans) {
    Piece& piece = plan.pieces.emplace_back();
    static_cast<PieceSpan&>(piece) = span;
    piece.payloadAt.push_back(plan.payloadTotal);
    for (int i = 0; i < n; ++i) {
      plan.payloadTotal += compress::encodedBytes(config, piece.chunks.length(i));
      piece.payloadAt.push_back(plan.payloadTotal);
    }
    piece.incomingAt = plan.incomingTotal;
    plan.incomingTotal += size_t(n) * piece.bytes(r);
    piece.residualAt = plan.residualTotal;
    plan.residualTotal += piece.chunks.length(r);
  }
  return plan;
}

// Per piece: a worker payload leaves as soon as it is encoded, this rank's own chunk is
// encoded last (so the others have that long to arrive), then the chunk is reduced and
// re-encoded in one pass (compress::reduceEncode) and all-gathered. The pieces are
// pipelined: step k encodes and reduces piece k, whose all-gather then overlaps the encode
// of piece k+1, and decodes piece k-1. Every receive is posted up front, in the order
// every peer sends: scatter(k), then gather(k). Among `members` (the group, or one rank per
// host), over `spans` (offsets into a.data); the sum is multiplied by `factor`.
void scatterReduceGather(Call& call, const CompressedAllreduceArgs& a, const ring::Members& members,
                         const std::vector<PieceSpan>& spans, float factor) {
  const int n = members.n(), r = members.self;
  const int me = call.comm().rank(), size = call.comm().size();  // the randomness streams' rank
  Communicator& comm = call.comm();
  const size_t es = elementSize(a.dtype);
  const Plan plan = planOf(a.config, spans, r, n);
  const std::vector<Piece>& pieces = plan.pieces;
  const size_t payloadTotal = plan.payloadTotal;
  // Reduced payloads arrive in `gathered` while later worker payloads still leave `outgoing`.
  uint8_t* outgoing = reinterpret_cast<uint8_t*>(comm.scratch(2 * payloadTotal, 0));
  uint8_t* gathered = outgoing + payloadTotal;
  uint8_t* incoming = reinterpret_cast<uint8_t*>(comm.scratch(plan.incomingTotal, 1));
  char* data = static_cast<char*>(a.data);
  auto rank = [&](int j) { return members.ranks[size_t(j)]; };

  std::vector<PeerExchange*> scatter, gather;
  for (const Piece& piece : pieces) {
    scatter.push_back(&call.exchange());
    gather.push_back(&call.exchange());
    const size_t mine = piece.bytes(r);
    for (int s = 1; s < n; ++s) {
      const int from = (r - s + n) % n;
      scatter.back()->recv(rank(from), incoming + piece.incomingAt + size_t(from) * mine, mine);
    }
    for (int s = 1; s < n; ++s) {
      const int from = (r - s + n) % n;
      gather.back()->recv(rank(from), gathered + piece.payloadAt[size_t(from)], piece.bytes(from));
    }
  }

  auto encodeAndSend = [&](size_t k) {
    const Piece& piece = pieces[k];
    auto encodeChunk = [&](int i, uint8_t* payload) {
      const size_t begin = piece.begin + piece.chunks.begin(i);
      const size_t written = compress::encode(
          a.config, a.dtype, data + begin * es, a.workerResidual ? a.workerResidual + begin : nullptr,
          piece.chunks.length(i), encodeStream(a.stream, me, 0, i, size, k), payload, piece.bytes(i));
      DDLCOMM_CHECK(written == piece.bytes(i), ErrorKind::Protocol, "payload of ", written, " bytes, expected ",
                    piece.bytes(i));
    };
    for (int s = 1; s < n; ++s) {
      const int to = (r + s) % n;
      encodeChunk(to, outgoing + piece.payloadAt[size_t(to)]);
      scatter[k]->send(rank(to), outgoing + piece.payloadAt[size_t(to)], piece.bytes(to));
    }
    encodeChunk(r, incoming + piece.incomingAt + size_t(r) * piece.bytes(r));
  };
  // Sums chunk r of every rank in rank order, in float32, re-encodes the sum with the server
  // residual and sends it to every peer.
  auto reduceAndSend = [&](size_t k) {
    const Piece& piece = pieces[k];
    const size_t mine = piece.bytes(r);
    std::vector<const uint8_t*> payloads(static_cast<size_t>(n));
    for (int j = 0; j < n; ++j) {
      scatter[k]->waitRecv(rank(j));
      payloads[size_t(j)] = incoming + piece.incomingAt + size_t(j) * mine;
    }
    uint8_t* reduced = gathered + piece.payloadAt[size_t(r)];
    const size_t written = compress::reduceEncode(
        a.config, payloads.data(), payloads.size(), mine, piece.chunks.length(r), factor,
        a.serverResidual ? a.serverResidual + piece.residualAt : nullptr, encodeStream(a.stream, me, 1, r, size, k),
        reduced, mine);
    DDLCOMM_CHECK(written == mine, ErrorKind::Protocol, "server payload of ", written, " bytes, expected ", mine);
    for (int s = 1; s < n; ++s) gather[k]->send(rank((r + s) % n), reduced, mine);
  };
  // Every rank decodes the same bytes: its own chunk first, then the others as they arrive.
  auto decode = [&](size_t k) {
    const Piece& piece = pieces[k];
    for (int s = 0; s < n; ++s) {
      const int j = (r - s + n) % n;
      gather[k]->waitRecv(rank(j));
      checkedDecode(a, gathered + piece.payloadAt[size_t(j)], piece.bytes(j), a.dtype,
                    data + (piece.begin + piece.chunks.begin(j)) * es, piece.chunks.length(j));
    }
  };

  for (size_t k = 0; k <= pieces.size(); ++k) {
    if (k < pieces.size()) {
      encodeAndSend(k);
      reduceAndSend(k);
    }
    if (k > 0) decode(k - 1);
  }
  for (size_t k = 0; k < pieces.size(); ++k) {
    scatter[k]->waitSends();
    gather[k]->waitSends();
  }
}

}  // namespace

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

// Exact inside the host, compressed across hosts: a ring reduce-scatter of every piece among
// the host's ranks (sums in the tensor's dtype), the compressed scatter-reduce-gather of this
// rank's shard with the ranks at its place on the other hosts (error feedback on that shard,
// kept by this rank), a ring all-gather inside the host. Every rank decodes or copies the
// same bytes, so every rank ends with the same bits.
void hierarchicalScatterReduceGather(Call& call, const CompressedAllreduceArgs& a) {
  const Topology& topology = call.comm().topology();
  const int r = call.comm().rank(), n = call.comm().size();
  const ring::Members host = ring::Members::of(topology.hostRanks(), r);
  const ring::Members across = ring::Members::of(topology.peersAcrossHosts(), r);
  const HostPlan plan = hostPlanOf(topology, a.count, r, n);
  char* data = static_cast<char*>(a.data);
  const size_t es = elementSize(a.dtype);
  const std::vector<PieceSpan> pieces = piecesOf(a.count, n);
  for (size_t k = 0; k < pieces.size(); ++k) {
    ring::reduceScatterInPlace(call, data + pieces[k].begin * es, plan.inHost[k], a.dtype, ReduceOp::Sum, host);
  }
  scatterReduceGather(call, a, across, plan.across, a.average ? 1.f / float(n) : 1.f);
  for (size_t k = 0; k < pieces.size(); ++k) {
    ring::allgatherInPlace(call, data + pieces[k].begin * es, plan.inHost[k], a.dtype, host);
  }
}

// The scatter-reduce-gather's hierarchy (quantizers and casts), where the topology suits it (as
// the exact all-reduce's choice, and forced alike); sparse formats have none of its residuals.
bool hierarchical(const Communicator& comm, const compress::Config& config, bool flat) {
  return !flat && !compress::isSparse(config.format) && compressedTwoLevels(comm);
}

}  // namespace

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

bool compressedTwoLevels(const Communicator& comm) { return layeredByHost(comm); }

std::vector<std::pair<size_t, size_t>> serverChunks(const Communicator& comm, const compress::Config& config,
                                                    size_t count, bool flat) {
  return serverChunks(comm.topology(), hierarchical(comm, config, flat), count, comm.rank(), comm.size());
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

size_t compressedAllreduceWireBytes(const compress::Config& config, size_t count, int rank, int size) {
  if (count == 0 || size == 1) return 0;
  if (compress::isSparse(config.format)) return size_t(size - 1) * compress::encodedBytes(config, count);
  // Per piece: every worker payload but its own chunk's, then its server payload to each peer.
  size_t total = 0;
  for (const Piece& piece : planOf(config, piecesOf(count, size), rank, size).pieces) {
    const size_t mine = piece.bytes(rank);
    total += piece.payloadAt.back() - piece.payloadAt.front() - mine + size_t(size - 1) * mine;
  }
  return total;
}

void compressedAllreduce(Communicator& comm, const CompressedAllreduceArgs& a) {
  compress::checkFloatType(a.dtype, "the compressed all-reduce's tensor");
  comm.run(OpCode::CompressedAllreduce, a.dtype, a.count, [&](Call& call) {
    if (a.count == 0) return;
    const bool twoLevels = !a.flat && compressedTwoLevels(comm);
    if (compress::isSparse(a.config.format) && twoLevels) {
      ++comm.counters().hierarchicalCompressedAllreduces;
      hierarchicalSparse(call, a);
    } else if (compress::isSparse(a.config.format)) {
      sparseAmong(call, a, ring::Members::all(comm), static_cast<char*>(a.data), a.workerResidual, a.count,
                  a.average ? 1.f / float(comm.size()) : 1.f);
    } else if (hierarchical(comm, a.config, a.flat)) {
      ++comm.counters().hierarchicalCompressedAllreduces;
      hierarchicalScatterReduceGather(call, a);
    } else {
      scatterReduceGather(call, a, ring::Members::all(comm), piecesOf(a.count, comm.size()),
                          a.average ? 1.f / float(comm.size()) : 1.f);
    }
  });
}

}  // namespace ddlcomm
