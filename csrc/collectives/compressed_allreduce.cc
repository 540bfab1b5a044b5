#include "collectives/compressed_allreduce.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "collectives/collectives.h"
#include "common/half.h"

namespace ddlcomm {
namespace {

bool isSparse(compress::Format f) { return f == compress::Format::TopK || f == compress::Format::RandomK; }

// Every rank sends `mine` to every other rank and receives theirs at their offsets.
void gatherPayloads(Call& call, const uint8_t* mine, size_t mineBytes, uint8_t* all,
                    const std::vector<size_t>& offsets, const std::vector<size_t>& sizes) {
  const int n = call.comm().size(), r = call.comm().rank();
  std::vector<Request> sends(static_cast<size_t>(n)), recvs(static_cast<size_t>(n));
  for (int s = 1; s < n; ++s) {
    int from = (r - s + n) % n, to = (r + s) % n;
    call.recv(recvs[size_t(from)], from, all + offsets[size_t(from)], sizes[size_t(from)]);
    call.send(sends[size_t(to)], to, mine, mineBytes);
  }
  if (all + offsets[size_t(r)] != mine) std::memcpy(all + offsets[size_t(r)], mine, mineBytes);
  for (int s = 1; s < n; ++s) {
    call.wait(recvs[size_t((r - s + n) % n)]);
    call.wait(sends[size_t((r + s) % n)]);
  }
}

void writeOut(const float* acc, DataType dtype, void* out, size_t count) {
  switch (dtype) {
    case DataType::Float32: std::memcpy(out, acc, count * sizeof(float)); return;
    case DataType::Float16:
      for (size_t i = 0; i < count; ++i) static_cast<uint16_t*>(out)[i] = floatToFp16(acc[i]);
      return;
    case DataType::BFloat16:
      for (size_t i = 0; i < count; ++i) static_cast<uint16_t*>(out)[i] = floatToBf16(acc[i]);
      return;
    default: fail(ErrorKind::UnsupportedType, "compressed all-reduce needs float32, float16 or bfloat16");
  }
}

void scale(float* acc, size_t count, float factor) {
  for (size_t i = 0; i < count; ++i) acc[i] *= factor;
}

void sparseAllreduce(Call& call, const CompressedAllreduceArgs& a) {
  const int n = call.comm().size(), r = call.comm().rank();
  Communicator& comm = call.comm();
  const size_t capacity = compress::encodedBytes(a.config, a.count);
  std::vector<size_t> sizes(static_cast<size_t>(n), capacity), offsets(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) offsets[size_t(i)] = size_t(i) * capacity;
  uint8_t* all = reinterpret_cast<uint8_t*>(comm.scratch(size_t(n) * capacity, 0));
  uint8_t* mine = all + offsets[size_t(r)];
  size_t written = compress::encode(a.config, a.dtype, a.data, a.workerResidual, a.count,
                                    encodeStream(a.stream, r, 0, 0, n), mine, capacity);
  DDLCOMM_CHECK(written == capacity, ErrorKind::Protocol, "sparse payload of ", written, " bytes, expected ", capacity);
  gatherPayloads(call, mine, written, all, offsets, sizes);
  float* acc = reinterpret_cast<float*>(comm.scratch(a.count * sizeof(float), 1));
  std::fill(acc, acc + a.count, 0.f);
  for (int j = 0; j < n; ++j) {
    compress::checkPayloadConfig(all + offsets[size_t(j)], sizes[size_t(j)], a.config);
    compress::decodeAccumulate(all + offsets[size_t(j)], sizes[size_t(j)], acc, a.count);
  }
  if (a.average) scale(acc, a.count, 1.f / float(n));
  writeOut(acc, a.dtype, a.data, a.count);
}

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
  const size_t mineBytes = chunkBytes[size_t(r)];

  // 1. Encode every chunk with the worker residual.
  uint8_t* outgoing = reinterpret_cast<uint8_t*>(comm.scratch(chunkOffsets[size_t(n)], 0));
  char* data = static_cast<char*>(a.data);
  for (int i = 0; i < n; ++i) {
    size_t written = compress::encode(a.config, a.dtype, data + chunks.begin(i) * es,
                                      a.workerResidual ? a.workerResidual + chunks.begin(i) : nullptr,
                                      chunks.length(i), encodeStream(a.stream, r, 0, i, n),
                                      outgoing + chunkOffsets[size_t(i)], chunkBytes[size_t(i)]);
    DDLCOMM_CHECK(written == chunkBytes[size_t(i)], ErrorKind::Protocol, "payload of ", written, " bytes, expected ",
                  chunkBytes[size_t(i)]);
  }

  // 2. All-to-all: chunk r of every rank comes here.
  uint8_t* incoming = reinterpret_cast<uint8_t*>(comm.scratch(size_t(n) * mineBytes, 1));
  {
    std::vector<Request> sends(static_cast<size_t>(n)), recvs(static_cast<size_t>(n));
    for (int s = 1; s < n; ++s) {
      int from = (r - s + n) % n, to = (r + s) % n;
      call.recv(recvs[size_t(from)], from, incoming + size_t(from) * mineBytes, mineBytes);
      call.send(sends[size_t(to)], to, outgoing + chunkOffsets[size_t(to)], chunkBytes[size_t(to)]);
    }
    std::memcpy(incoming + size_t(r) * mineBytes, outgoing + chunkOffsets[size_t(r)], mineBytes);
    for (int s = 1; s < n; ++s) {
      call.wait(recvs[size_t((r - s + n) % n)]);
      call.wait(sends[size_t((r + s) % n)]);
    }
  }

  // 3. Sum in rank order, in float32; 4. re-encode with the server residual.
  const size_t mineLength = chunks.length(r);
  float* acc = reinterpret_cast<float*>(comm.scratch(mineLength * sizeof(float), 2));
  std::fill(acc, acc + mineLength, 0.f);
  for (int j = 0; j < n; ++j) {
    compress::checkPayloadConfig(incoming + size_t(j) * mineBytes, mineBytes, a.config);
    compress::decodeAccumulate(incoming + size_t(j) * mineBytes, mineBytes, acc, mineLength);
  }
  if (a.average) scale(acc, mineLength, 1.f / float(n));
  uint8_t* gathered = outgoing;  // the worker payloads have been sent; reuse the buffer
  size_t written = compress::encode(a.config, DataType::Float32, acc, a.serverResidual, mineLength,
                                    encodeStream(a.stream, r, 1, r, n), gathered + chunkOffsets[size_t(r)], mineBytes);
  DDLCOMM_CHECK(written == mineBytes, ErrorKind::Protocol, "server payload of ", written, " bytes, expected ", mineBytes);

  // 5. All-gather the reduced chunks; 6. every rank decodes the same bytes.
  std::vector<size_t> offsets(chunkOffsets.begin(), chunkOffsets.end() - 1);
  gatherPayloads(call, gathered + chunkOffsets[size_t(r)], mineBytes, gathered, offsets, chunkBytes);
  for (int j = 0; j < n; ++j) {
    compress::checkPayloadConfig(gathered + chunkOffsets[size_t(j)], chunkBytes[size_t(j)], a.config);
    compress::decode(gathered + chunkOffsets[size_t(j)], chunkBytes[size_t(j)], a.dtype, data + chunks.begin(j) * es,
                     chunks.length(j));
  }
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
