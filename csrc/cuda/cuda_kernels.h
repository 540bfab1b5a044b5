// CUDA twins of the CPU compression kernels (csrc/compress): raw device pointers, one
// cudaStream_t, no torch. Every launcher is asynchronous and stream-ordered: it never
// synchronizes, never allocates (scratch comes from a caller-provided workspace) and throws
// ddlcomm::Error (System) when a launch fails, InvalidArgument/UnsupportedType for bad input.
//
// Payload bytes follow compress/wire_format.h and the cross-device contract in
// compress/compress.h; where that contract leaves a choice, the GPU's choice is documented
// in docs/cuda.md ("Contract details") and checked by tests/cuda/test_cuda_kernels.cc.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "common/dtype.h"
#include "compress/compress.h"

namespace ddlcomm::gpu {

// Exact payload size for every format (approximate top-k on the GPU keeps exactly k entries);
// compress::payloadLayout's, after the GPU's argument checks. Entries kept by top-k / random-k:
// compress::keptEntries.
size_t encodedBytesCuda(const compress::Config& config, size_t numel);

// Device scratch that encodeCuda needs (0 but for top-k and random-k). Alignment: 256 bytes.
size_t encodeWorkspaceBytes(const compress::Config& config, DataType xType, size_t numel);

// y = x + residual; payload = encode(y); residual = y - decode(payload), in one stream-ordered
// sequence of kernels. x: numel elements of xType (float32, float16, bfloat16) in device
// memory; residual: float32[numel] in device memory, or null (no error feedback); payload:
// device memory, 4-byte aligned, capacity >= encodedBytesCuda(config, numel); the header is
// written by the device. Returns the payload size (known on the host, no synchronization).
size_t encodeCuda(const compress::Config& config, DataType xType, const void* x, float* residual, size_t numel,
                  uint64_t stream, uint8_t* payload, size_t capacity, void* workspace, size_t workspaceBytes,
                  cudaStream_t cudaStream);

// What compress::inspect would report for a payload of `config` and `numel` elements, checked
// against its size `bytes` (Protocol otherwise): the decoders' description of a payload
// whose header is in device memory, where the host cannot read it.
compress::PayloadInfo expectedInfo(const compress::Config& config, size_t numel, size_t bytes);

// out[numel] (float32, float16, bfloat16) = decode(payload). `info` comes from
// compress::inspect run on the host over a copy of the same bytes (the device trusts it, but
// still never reads or writes outside payload[bytes] / out[numel]).
void decodeCuda(const compress::PayloadInfo& info, const uint8_t* payload, size_t bytes, DataType outType, void* out,
                size_t numel, cudaStream_t cudaStream);

// out[numel] (float32) += decode(payload), element by element with one float32 add.
// Sparse formats (top-k, random-k) touch only the entries they carry.
void decodeAccumulateCuda(const compress::PayloadInfo& info, const uint8_t* payload, size_t bytes, float* out,
                          size_t numel, cudaStream_t cudaStream);

// ---- Several chunks a call ----------------------------------------------------------------
// A compressed collective encodes a chunk of a bucket for every rank and decodes every rank's
// chunk. These calls take them together: the block formats (1-bit, ternary) and the casts
// enqueue one kernel for up to 16 chunks (1-bit and ternary with a block size that is not a
// whole number of code bytes, and the sparse formats, their sequence per chunk), with the
// bytes, checks and results of the calls above, chunk by chunk.

// encodeCuda's arguments for one chunk.
struct EncodeChunk {
  const void* x;
  float* residual;  // or null
  size_t numel;
  uint64_t stream;
  uint8_t* payload;
  size_t capacity;
};

// decodeCuda's arguments for one chunk: a payload of the call's config.
struct DecodeChunk {
  const uint8_t* payload;
  size_t bytes;
  void* out;
  size_t numel;
};

// encodeCuda of every chunk. The workspace serves them all (encodeWorkspaceBytes of the largest).
void encodeChunksCuda(const compress::Config& config, DataType xType, const EncodeChunk* chunks, size_t n,
                      void* workspace, size_t workspaceBytes, cudaStream_t cudaStream);

// decodeCuda of every chunk.
void decodeChunksCuda(const compress::Config& config, const DecodeChunk* chunks, size_t n, DataType outType,
                      cudaStream_t cudaStream);

// out[numel] (float32) = scale * the sum, from 0 in order j = 0 .. n-1, of decode(payloads[j]),
// payloads of `config` and numel elements, one float32 add each and then one multiply unless
// scale is 1: as compress::reduceEncode sums. Block formats and casts (sparse payloads are
// summed with decodeAccumulateCuda).
void sumPayloadsCuda(const compress::Config& config, const uint8_t* const* payloads, size_t n, size_t numel,
                     float scale, float* out, cudaStream_t cudaStream);

}  // namespace ddlcomm::gpu
