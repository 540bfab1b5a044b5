#include "collectives/compressed_reduce_scatter.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "collectives/compressed_allreduce.h"  // encodeStream
#include "compress/elements.h"
#include "reduce/reduce.h"

namespace ddlcomm {
namespace {

// out = sum * factor in out's dtype, one pass (no multiply for factor 1).
template <class E>
void store(const float* sum, float factor, void* out, size_t count) {
  auto* o = static_cast<typename E::Raw*>(out);
  if (factor == 1.f) {
    for (size_t i = 0; i < count; ++i) o[i] = E::store(sum[i]);
  } else {
    for (size_t i = 0; i < count; ++i) o[i] = E::store(sum[i] * factor);
  }
}

// Every member encodes chunk i of `chunks` (for members.ranks[i], `count` elements) with the
// worker residual of that rank's chunk and sends it, its own last; this rank sums the members'
// payloads of its chunk into `sum`, in member order. Flat, the members are the group and
// `chunks` the caller's input.
void scatterReduce(Call& call, const CompressedReduceScatterArgs& a, const char* chunks, const ring::Members& members,
                   float* sum) {
  Communicator& comm = call.comm();
  const int n = comm.size(), r = comm.rank(), k = members.n();
  const size_t es = elementSize(a.dtype);
  const size_t bytes = compress::encodedBytes(a.config, a.count);
  // outgoing: the k - 1 chunks for the other members; incoming: the k payloads of this rank's.
  auto* outgoing = reinterpret_cast<uint8_t*>(comm.scratch(size_t(k) * bytes, 0));
  auto* incoming = reinterpret_cast<uint8_t*>(comm.scratch(size_t(k) * bytes, 1));
  PeerExchange& scatter = call.exchange();
  for (int s = 1; s < k; ++s) {
    const int from = (members.self - s + k) % k;
    scatter.recv(members.ranks[size_t(from)], incoming + size_t(from) * bytes, bytes);
  }
  auto encodeChunk = [&](int i, uint8_t* payload) {
    const int owner = members.ranks[size_t(i)];
    float* residual = a.workerResidual ? a.workerResidual + size_t(owner) * a.count : nullptr;
    const size_t written = compress::encode(a.config, a.dtype, chunks + size_t(i) * a.count * es, residual, a.count,
                                            encodeStream(a.stream, r, 0, owner, n, 0), payload, bytes);
    DDLCOMM_CHECK(written == bytes, ErrorKind::Protocol, "payload of ", written, " bytes, expected ", bytes);
  };
  for (int s = 1; s < k; ++s) {
    const int to = (members.self + s) % k;
    encodeChunk(to, outgoing + size_t(to) * bytes);
    scatter.send(members.ranks[size_t(to)], outgoing + size_t(to) * bytes, bytes);
  }
  encodeChunk(members.self, incoming + size_t(members.self) * bytes);
  std::fill(sum, sum + a.count, 0.f);
  for (int j = 0; j < k; ++j) {
    scatter.waitRecv(members.ranks[size_t(j)]);
    const uint8_t* payload = incoming + size_t(j) * bytes;
    compress::checkPayloadConfig(payload, bytes, a.config);
    compress::decodeAccumulate(payload, bytes, sum, a.count);
  }
  scatter.waitSends();
}

// Exact inside the host first: every rank sends each other rank of its host the chunks of the
// ranks at that rank's place on every host, straight from the input, and sums what it receives
// for its own place in the host's rank order. Local rank l ends with the host's sums of the
// chunks of the ranks at place l on every host (in host order), the chunks it then
// scatter-reduces, compressed, with those ranks. Returns where the sums are.
const char* reducedInHost(Call& call, const CompressedReduceScatterArgs& a) {
  Communicator& comm = call.comm();
  const Topology& topology = comm.topology();
  const ring::Members host = ring::Members::of(topology.hostRanks(), comm.rank());
  const int hosts = topology.hosts(), places = host.n();
  const size_t chunkBytes = a.count * elementSize(a.dtype);
  const char* input = static_cast<const char*>(a.input);
  auto chunk = [&](int place, int h) { return input + size_t(topology.ranksOfHost(h)[size_t(place)]) * chunkBytes; };
  // Slots 0-2 are the scatter's; one incoming block of `hosts` chunks per other place.
  char* sums = comm.scratch(size_t(hosts) * chunkBytes, 3);
  char* incoming = comm.scratch(size_t(places - 1) * size_t(hosts) * chunkBytes, 4);
  auto from = [&](int place, int h) {
    const size_t block = size_t((place - host.self + places) % places - 1);
    return incoming + (block * size_t(hosts) + size_t(h)) * chunkBytes;
  };
  std::vector<PeerExchange*> exchanges;  // one per host: one message each way per peer
  for (int h = 0; h < hosts; ++h) {
    PeerExchange& exchange = *exchanges.emplace_back(&call.exchange());
    for (int s = 1; s < places; ++s) {
      const int peer = (host.self + s) % places, source = (host.self - s + places) % places;
      exchange.recv(host.ranks[size_t(source)], from(source, h), chunkBytes);
      exchange.send(host.ranks[size_t(peer)], chunk(peer, h), chunkBytes);
    }
  }
  for (int h = 0; h < hosts; ++h) {
    char* sum = sums + size_t(h) * chunkBytes;
    for (int place = 0; place < places; ++place) {
      if (place != host.self) exchanges[size_t(h)]->waitRecv(host.ranks[size_t(place)]);
      const char* part = place == host.self ? chunk(host.self, h) : from(place, h);
      if (place == 0) {
        std::memcpy(sum, part, chunkBytes);
      } else {
        reduceInto(ReduceOp::Sum, a.dtype, sum, part, a.count);
      }
    }
  }
  for (PeerExchange* exchange : exchanges) exchange->waitSends();
  return sums;
}

}  // namespace

size_t compressedReduceScatterWireBytes(const compress::Config& config, size_t count, int size) {
  return count == 0 ? 0 : size_t(size - 1) * compress::encodedBytes(config, count);
}

void compressedReduceScatter(Communicator& comm, const CompressedReduceScatterArgs& a) {
  compress::checkFloatType(a.dtype, "the compressed reduce-scatter's tensor");
  comm.run(OpCode::CompressedReduceScatter, a.dtype, a.count, [&](Call& call) {
    if (a.count == 0) return;
    // A float32 output holds the sum itself; the others get it converted at the end.
    auto* sum = a.dtype == DataType::Float32 ? static_cast<float*>(a.output)
                                             : reinterpret_cast<float*>(comm.scratch(a.count * sizeof(float), 2));
    if (layeredByHost(comm)) {
      ++comm.counters().hierarchicalCompressedReduceScatters;
      scatterReduce(call, a, reducedInHost(call, a), ring::Members::of(comm.topology().peersAcrossHosts(), comm.rank()),
                    sum);
    } else {
      scatterReduce(call, a, static_cast<const char*>(a.input), ring::Members::all(comm), sum);
    }
    const float factor = a.average ? float(1.0 / double(comm.size())) : 1.f;
    switch (a.dtype) {
      case DataType::Float16: store<compress::F16>(sum, factor, a.output, a.count); break;
      case DataType::BFloat16: store<compress::BF16>(sum, factor, a.output, a.count); break;
      default:
        if (factor != 1.f) store<compress::F32>(sum, factor, a.output, a.count);
        break;
    }
  });
}

}  // namespace ddlcomm
