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

void encodeOneBit(const EncodeArgs& a);
void decodeOneBit(const DecodeArgs& a);
void encodeTernary(const EncodeArgs& a);
void decodeTernary(const DecodeArgs& a);
void encodeCast(const EncodeArgs& a);
void decodeCast(const DecodeArgs& a);
void encodeTopK(const EncodeArgs& a);
void encodeRandomK(const EncodeArgs& a);
void decodeSparse(const DecodeArgs& a);

size_t randomkWorkspaceBytes(uint64_t numel, uint64_t k);
size_t ternaryWorkspaceBytes(const compress::Config& config, uint64_t numel);
size_t topkWorkspaceBytes(bool approximate, uint64_t numel, uint64_t k, unsigned valueBits);

}  // namespace ddlcomm::gpu::detail
