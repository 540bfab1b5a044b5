// Compressed reduce-scatter with error feedback, for FSDP2's gradient reduce-scatter
// (ddlcomm.fsdp). The first half of the compressed all-reduce, over the caller's chunks: every
// rank encodes chunk i of its input and sends it to rank i, which sums the n payloads in rank
// order. The Python algorithm over other backends (ddlcomm/fsdp.py) gives the same bits.
// Where the group takes two levels (layeredByHost), the chunks are first reduced exactly inside
// each host (ring reduce-scatter, sums in the tensor's dtype) and only the host sums are
// compressed, each by the rank at its owner's place on the host, and sent across hosts.
#pragma once

#include <cstddef>
#include <cstdint>

#include "collectives/communicator.h"
#include "compress/compress.h"

namespace ddlcomm {

struct CompressedReduceScatterArgs {
  compress::Config config;
  DataType dtype = DataType::Float32;  // of input and output: float32, float16 or bfloat16
  const void* input = nullptr;         // n * count elements; chunk i goes to rank i
  void* output = nullptr;              // count elements: the reduction of every rank's chunk `rank`
  size_t count = 0;
  float* workerResidual = nullptr;  // float32[n * count], or null for no error feedback
  bool average = true;              // multiply the float32 sum by float(1.0 / n)
  uint64_t stream = 0;              // randomness stream of this call
};

// Chunk i is encoded with encodeStream(stream, rank, 0, i, n, 0) and its worker residual
// (elements [i * count, (i + 1) * count)) and leaves as soon as it is encoded, this rank's own
// last; rank r decodes its payloads (n flat, one per host in two levels) into a float32 sum in
// rank order (decodeAccumulate), scales it for an average, and writes it out in `dtype`.
void compressedReduceScatter(Communicator& comm, const CompressedReduceScatterArgs& args);

// Payload bytes every rank sends in one flat compressed reduce-scatter of `count` output elements.
size_t compressedReduceScatterWireBytes(const compress::Config& config, size_t count, int size);

}  // namespace ddlcomm
