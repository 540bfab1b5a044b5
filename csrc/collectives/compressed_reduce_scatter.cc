#include "collectives/compressed_reduce_scatter.h"

#include <algorithm>
#include <vector>

#include "collectives/compressed_allreduce.h"  // encodeStream
#include "compress/elements.h"

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

}  // namespace

size_t compressedReduceScatterWireBytes(const compress::Config& config, size_t count, int size) {
  return count == 0 ? 0 : size_t(size - 1) * compress::encodedBytes(config, count);
}

void compressedReduceScatter(Communicator& comm, const CompressedReduceScatterArgs& a) {
  compress::checkFloatType(a.dtype, "the compressed reduce-scatter's tensor");
  comm.run(OpCode::CompressedReduceScatter, a.dtype, a.count, [&](Call& call) {
    if (a.count == 0) return;
    const int n = comm.size(), r = comm.rank();
    const size_t es = elementSize(a.dtype);
    const size_t bytes = compress::encodedBytes(a.config, a.count);
    // outgoing: the n - 1 chunks for the peers; incoming: the n payloads of chunk r, by rank.
    auto* outgoing = reinterpret_cast<uint8_t*>(comm.scratch(size_t(n) * bytes, 0));
    auto* incoming = reinterpret_cast<uint8_t*>(comm.scratch(size_t(n) * bytes, 1));
    // A float32 output holds the sum itself; the others get it converted at the end.
    auto* sum = a.dtype == DataType::Float32 ? static_cast<float*>(a.output)
                                             : reinterpret_cast<float*>(comm.scratch(a.count * sizeof(float), 2));
    const char* input = static_cast<const char*>(a.input);
    PeerExchange& scatter = call.exchange();
    for (int s = 1; s < n; ++s) {
      const int from = (r - s + n) % n;
      scatter.recv(from, incoming + size_t(from) * bytes, bytes);
    }
    auto encodeChunk = [&](int i, uint8_t* payload) {
      const size_t begin = size_t(i) * a.count;
      const size_t written =
          compress::encode(a.config, a.dtype, input + begin * es, a.workerResidual ? a.workerResidual + begin : nullptr,
                           a.count, encodeStream(a.stream, r, 0, i, n, 0), payload, bytes);
      DDLCOMM_CHECK(written == bytes, ErrorKind::Protocol, "payload of ", written, " bytes, expected ", bytes);
    };
    for (int s = 1; s < n; ++s) {
      const int to = (r + s) % n;
      encodeChunk(to, outgoing + size_t(to) * bytes);
      scatter.send(to, outgoing + size_t(to) * bytes, bytes);
    }
    encodeChunk(r, incoming + size_t(r) * bytes);
    std::fill(sum, sum + a.count, 0.f);
    for (int j = 0; j < n; ++j) {
      scatter.waitRecv(j);
      const uint8_t* payload = incoming + size_t(j) * bytes;
      compress::checkPayloadConfig(payload, bytes, a.config);
      compress::decodeAccumulate(payload, bytes, sum, a.count);
    }
    scatter.waitSends();
    const float factor = a.average ? float(1.0 / double(n)) : 1.f;
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
