// Per-format launchers behind encodeCuda / decodeCuda (dispatch.cc validates the arguments
// and computes the layout, compress/wire_format.h's, first). Internal to csrc/cuda.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "common/dtype.h"
#include "compress/compress.h"

namespace ddlcomm::gpu {

// The 32 header bytes as 8 little-endian words, handed to a kernel by value.
struct HeaderWords {
  uint32_t w[8];
};
static_assert(sizeof(HeaderWords) == sizeof(compress::PayloadHeader), "one header, two views");

inline HeaderWords headerWords(const compress::PayloadHeader& header) {
  HeaderWords h;
  std::memcpy(&h, &header, sizeof h);
  return h;
}

}  // namespace ddlcomm::gpu

namespace ddlcomm::gpu::detail {

struct EncodeArgs {
  compress::Config config;
  DataType xType;
  const void* x;
  float* residual;  // may be null
  uint64_t numel;
  uint64_t stream;  // randomness stream (not the CUDA stream)
  uint64_t k;       // entries kept (top-k, random-k)
  uint8_t* payload;
  compress::PayloadLayout layout;
  HeaderWords header;
  void* workspace;
  size_t workspaceBytes;
  cudaStream_t cudaStream;
};

struct DecodeArgs {
  compress::Format format;
  bool twoScales;
  uint32_t blockSize;
  uint64_t numel;
  uint64_t k;
  unsigned valueBits;  // top-k value codes; 0: float32 values
  const uint8_t* payload;
  compress::PayloadLayout layout;
  DataType outType;  // Float32 when accumulating
  void* out;
  bool accumulate;   // out (float32) += decoded
  cudaStream_t cudaStream;
};

// Several chunks a call: a compressed collective encodes a chunk of a bucket for every rank and
// decodes every rank's chunk. The block formats (with whole code bytes a block) and the casts
// take them in one launch per kMaxParts chunks; the others launch a sequence per chunk.
// Encodes of a call share config, xType, workspace and cudaStream; decodes share outType,
// accumulate and cudaStream; each chunk has its own x, residual, numel, stream and payload.
constexpr uint32_t kMaxParts = 16;

void encodeOneBit(const EncodeArgs* a, size_t n);
void decodeOneBit(const DecodeArgs* a, size_t n);
void encodeTernary(const EncodeArgs* a, size_t n);
void decodeTernary(const DecodeArgs* a, size_t n);
void encodeCast(const EncodeArgs* a, size_t n);
void decodeCast(const DecodeArgs* a, size_t n);
void encodeTopK(const EncodeArgs& a);
void encodeRandomK(const EncodeArgs& a);
void decodeSparse(const DecodeArgs& a);

// out (float32, numel of every a[j]) = scale * the sum of decode(a[j]) in order from 0: the
// payloads of one chunk from every rank, summed as compress::reduceEncode sums them (one
// float32 add each, then one multiply unless scale is 1). Block formats and casts.
void sumOneBit(const DecodeArgs* a, size_t n, float scale, float* out);
void sumTernary(const DecodeArgs* a, size_t n, float scale, float* out);
void sumCast(const DecodeArgs* a, size_t n, float scale, float* out);

size_t randomkWorkspaceBytes(uint64_t numel, uint64_t k);
size_t ternaryWorkspaceBytes(const compress::Config& config, uint64_t numel);
size_t topkWorkspaceBytes(bool approximate, uint64_t numel, uint64_t k, unsigned valueBits);

}  // namespace ddlcomm::gpu::detail
