// Scalar host model of the payload contract (compress/wire_format.h, compress/compress.h and
// the GPU's documented choices in docs/cuda.md), written directly from the text with plain
// loops. The GPU test compares the CUDA kernels with it byte for byte; it is independent of
// the CUDA code and of the CPU kernels in csrc/compress: it takes only constants and Config
// from their headers, and has its own counter-based randomness (SplitMix64, reference.cc, not
// compress/counter_random.h, which the kernels share). Its float16 / bfloat16 conversions are
// common/half.h, the CPU's: the CUDA kernels convert with their own code (cuda/common.cuh), and
// tests/test_compress.py holds half.h to torch's conversions bit for bit.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "common/dtype.h"
#include "compress/compress.h"

namespace ddlcomm::ref {

float loadAsFloat(DataType type, const void* data, size_t i);
void storeFromFloat(DataType type, void* data, size_t i, float v);

uint64_t keptEntries(const compress::Config& config, size_t numel);

// Encodes x (+ residual, updated in place when non-null) into a complete payload. scaled:
// random-k values times float(double(numel) / k) (Config::scaled on the CPU branch).
std::vector<uint8_t> encode(const compress::Config& config, DataType xType, const void* x, float* residual,
                            size_t numel, uint64_t stream, bool scaled = false);

// One 1-bit block: y[count] -> scales (1 or 2), sign bits (bit e of the result = element e),
// and the residual values. Used by the large-size test to check selected blocks only.
void onebitBlock(const float* y, uint32_t count, bool twoScales, float* scales, std::vector<uint8_t>& bits,
                 float* residualOut);

// out (float32, float16, bfloat16) = decode(payload); the payload must be valid.
void decode(const uint8_t* payload, size_t bytes, DataType outType, void* out, size_t numel);
void decodeAccumulate(const uint8_t* payload, size_t bytes, float* out, size_t numel);

}  // namespace ddlcomm::ref
