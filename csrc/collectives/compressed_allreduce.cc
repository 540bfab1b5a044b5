#include "collectives/compressed_allreduce.h"

#include <cstring>
#include <vector>

#include "collectives/collectives.h"

namespace ddlcomm {
namespace {

bool isSparse(compress::Format f) { return f == compress::Format::TopK || f == compress::Format::RandomK; }

// Checks that a peer's payload was made with this rank's compressor, then decodes it.
void checkedDecode(const CompressedAllreduceArgs& a, const uint8_t* payload, size_t bytes, DataType outType,
                   void* out, size_t count) {
  compress::checkPayloadConfig(payload, bytes, a.config);
  compress::decode(payload, bytes, outType, out, count);
}

void sparseAllreduce(Call& call, const CompressedAllreduceArgs& a) {
  const int n = call.comm().size(), r = call.comm().rank();
  Communicator& comm = call.comm();
  const size_t capacity = compress::encodedBytes(a.config, a.count);
  uint8_t* all = reinterpret_cast<uint8_t*>(comm.scratch(size_t(n) * capacity, 0));
  uint8_t* mine = all + size_t(r) * capacity;
  const size_t written = compress::encode(a.config, a.dtype, a.data, a.workerResidual, a.count,
                                          encodeStream(a.stream, r, 0, 0, n), mine, capacity);
  DDLCOMM_CHECK(written == capacity, ErrorKind::Protocol, "sparse payload of ", written, " bytes, expected ", capacity);

  // All-gather of the payloads; the output is zeroed while they travel, then the entries
  // they carry are summed (in rank order) into it.
  PeerExchange& gather = call.exchange();
  for (int s = 1; s < n; ++s) {
    const int from = (r - s + n) % n, to = (r + s) % n;
    gather.recv(from, all + size_t(from) * capacity, capacity);
    gather.send(to, mine, capacity);
  }
  std::memset(a.data, 0, a.count * elementSize(a.dtype));  // +0 in float32, float16 and bfloat16
  std::vector<const uint8_t*> payloads(static_cast<size_t>(n));
  for (int j = 0; j < n; ++j) {
    gather.waitRecv(j);
    payloads[size_t(j)] = all + size_t(j) * capacity;
  }
  gather.waitSends();
  compress::sumSparse(a.config, payloads.data(), payloads.size(), capacity, a.count, a.average ? 1.f / float(n) : 1.f,
                      a.dtype, a.data);
}

// Transfers overlap computation: a worker payload leaves as soon as it is encoded (while the
// next one is encoded), and the reduced payloads are decoded as they arrive, this rank's own
// first. The sum and its re-encoding are one pass over the chunk (compress::reduceEncode).
void scatterReduceGather(Call& call, const CompressedAllreduceArgs& a) {
  const int n = call.comm().size(), r = call.comm().rank();
  Communicator& comm = call.comm();
  const size_t es = elementSize(a.dtype);
  const ring::Chunks chunks{a.count, n};
  std::vector<size_t> chunkBytes(static_cast<size_t>(n)), chunkOffsets(static_cast<size_t>(n) + 1, 0);
  for (int i = 0; i < n; ++i) {
    chunkBytes[size_t(i)] = compress::encodedBytes(a.config, chunks.length(i));
    chunkOffsets[size_t(i) + 1] = chunkOffsets[size_t(i)] + chunkBytes[size_t(i)];
  }
  const size_t mineBytes = chunkBytes[size_t(r)], mineLength = chunks.length(r);
  char* data = static_cast<char*>(a.data);
  auto encodeWorkerChunk = [&](int i, uint8_t* payload) {
    const size_t written = compress::encode(
        a.config, a.dtype, data + chunks.begin(i) * es, a.workerResidual ? a.workerResidual + chunks.begin(i) : nullptr,
        chunks.length(i), encodeStream(a.stream, r, 0, i, n), payload, chunkBytes[size_t(i)]);
    DDLCOMM_CHECK(written == chunkBytes[size_t(i)], ErrorKind::Protocol, "payload of ", written, " bytes, expected ",
                  chunkBytes[size_t(i)]);
  };

  // 1. All-to-all of the worker payloads: chunk i goes to rank i; this rank's own goes last.
  uint8_t* outgoing = reinterpret_cast<uint8_t*>(comm.scratch(chunkOffsets[size_t(n)], 0));
  uint8_t* incoming = reinterpret_cast<uint8_t*>(comm.scratch(size_t(n) * mineBytes, 1));
  PeerExchange& scatter = call.exchange();
  for (int s = 1; s < n; ++s) {
    const int from = (r - s + n) % n;
    scatter.recv(from, incoming + size_t(from) * mineBytes, mineBytes);
  }
  for (int s = 1; s < n; ++s) {
    const int to = (r + s) % n;
    encodeWorkerChunk(to, outgoing + chunkOffsets[size_t(to)]);
    scatter.send(to, outgoing + chunkOffsets[size_t(to)], chunkBytes[size_t(to)]);
  }
  encodeWorkerChunk(r, incoming + size_t(r) * mineBytes);

  // 2. Sum chunk r of every rank in rank order, in float32, and re-encode the sum with the
  //    server residual, into the all-gather buffer (once the worker payloads there have left).
  std::vector<const uint8_t*> payloads(static_cast<size_t>(n));
  for (int j = 0; j < n; ++j) {
    scatter.waitRecv(j);
    payloads[size_t(j)] = incoming + size_t(j) * mineBytes;
  }
  scatter.waitSends();
  uint8_t* gathered = outgoing;
  const size_t written = compress::reduceEncode(
      a.config, payloads.data(), payloads.size(), mineBytes, mineLength, a.average ? 1.f / float(n) : 1.f,
      a.serverResidual, encodeStream(a.stream, r, 1, r, n), gathered + chunkOffsets[size_t(r)], mineBytes);
  DDLCOMM_CHECK(written == mineBytes, ErrorKind::Protocol, "server payload of ", written, " bytes, expected ",
                mineBytes);

  // 3. All-gather the reduced payloads; every rank decodes the same bytes.
  PeerExchange& gather = call.exchange();
  for (int s = 1; s < n; ++s) {
    const int from = (r - s + n) % n, to = (r + s) % n;
    gather.recv(from, gathered + chunkOffsets[size_t(from)], chunkBytes[size_t(from)]);
    gather.send(to, gathered + chunkOffsets[size_t(r)], mineBytes);
  }
  for (int s = 0; s < n; ++s) {
    const int j = (r - s + n) % n;  // the order they arrive in
    gather.waitRecv(j);
    checkedDecode(a, gathered + chunkOffsets[size_t(j)], chunkBytes[size_t(j)], a.dtype, data + chunks.begin(j) * es,
                  chunks.length(j));
  }
  gather.waitSends();
}

}  // namespace

uint64_t encodeStream(uint64_t callStream, int rank, int phase, int chunk, int size) {
  return ((callStream * 2 + uint64_t(phase)) * uint64_t(size) + uint64_t(rank)) * uint64_t(size) + uint64_t(chunk);
}

size_t serverResidualLength(size_t count, int rank, int size) { return ring::Chunks{count, size}.length(rank); }

void compressedAllreduce(Communicator& comm, const CompressedAllreduceArgs& a) {
  DDLCOMM_CHECK(a.dtype == DataType::Float32 || a.dtype == DataType::Float16 || a.dtype == DataType::BFloat16,
                ErrorKind::UnsupportedType, "compressed all-reduce needs float32, float16 or bfloat16, got ",
                dataTypeName(a.dtype));
  comm.run(OpCode::CompressedAllreduce, a.dtype, a.count, [&](Call& call) {
    if (a.count == 0) return;
    if (isSparse(a.config.format)) {
      sparseAllreduce(call, a);
    } else {
      scatterReduceGather(call, a);
    }
  });
}

}  // namespace ddlcomm
