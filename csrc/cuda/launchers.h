// Per-format launchers behind encodeCuda / decodeCuda (dispatch.cc validates the arguments
// and computes the layout first). Internal to csrc/cuda.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "common/dtype.h"
#include "compress/compress.h"
#include "cuda/layout.h"

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
  PayloadLayout layout;
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
  const uint8_t* payload;
  PayloadLayout layout;
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
size_t topkWorkspaceBytes(bool approximate, uint64_t numel, uint64_t k);

}  // namespace ddlcomm::gpu::detail
