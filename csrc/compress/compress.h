// Compressors with error feedback, on raw CPU buffers (no torch). Each encode is one fused
// pass: y = x + residual; payload = encode(y); residual = y - decode(payload).
//
// Cross-device contract (the CUDA kernels in csrc/cuda/ follow it, so a payload encoded on
// either device is bit-identical for the deterministic formats):
//  - Block sums (1-bit scale = mean |y| of the block, ternary std) are float32 sums taken in
//    32 interleaved lanes (lane j sums elements j, j+32, ... in index order), then combined
//    lane[j] += lane[j+16], +8, +4, +2, +1; no fused multiply-add. Max is order-free.
//  - Randomness is counter-based: counterBits / counterUniform(seed, stream, index) (in
//    compress/counter_random.h, shared with device code), so results do not depend on
//    threading or device. Random-k takes Floyd's k distinct indices: for j = numel-k .. numel-1,
//    t = (counterBits(seed, stream, j) * (j+1)) >> 64 (128-bit product); take t, or j when t is
//    already taken. (The GPU computes the same set in parallel, see csrc/cuda/randomk.cu.)
//  - Non-finite input: the affected block's scale (or the top-k value) is non-finite so the
//    decoded result is non-finite too, and the residual of those elements is reset to 0
//    so later steps are not poisoned.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/dtype.h"
#include "compress/counter_random.h"
#include "compress/wire_format.h"

namespace ddlcomm::compress {

struct Config {
  Format format = Format::OneBit;
  uint32_t blockSize = 256;  // 1-bit / ternary: elements per scale
  bool twoScales = false;    // 1-bit SGD variant: one mean for y >= 0, one for y < 0
  float clip = 0.f;          // ternary: clip y at clip * std(block) before scaling; 0 = off
  double ratio = 0.01;       // top-k / random-k: fraction kept when k == 0
  uint64_t k = 0;            // top-k / random-k: entries kept (overrides ratio)
  bool approximate = false;  // top-k: threshold estimated on a sample (Deep Gradient Compression)
  uint64_t seed = 0;         // ternary / random-k randomness
};

// Entries kept by top-k / random-k for a vector of numel elements.
uint64_t keptEntries(const Config& config, size_t numel);
// Upper bound on (and, except for approximate top-k, exact) payload size.
size_t encodedBytes(const Config& config, size_t numel);

// x: numel elements of xType (float32, float16 or bfloat16). residual: float32[numel] or
// null (no error feedback). stream: distinguishes calls for the counter-based randomness
// (e.g. rank and step). Returns the payload size written into payload[capacity].
size_t encode(const Config& config, DataType xType, const void* x, float* residual, size_t numel, uint64_t stream,
              uint8_t* payload, size_t capacity);

struct PayloadInfo {
  Format format;
  uint8_t flags;
  uint32_t blockSize;
  uint64_t numel;
  uint64_t k;
};
// Validates a payload completely (header, exact size, index order and range, codes);
// throws Error(Protocol) describing the first problem.
PayloadInfo inspect(const uint8_t* payload, size_t bytes);

// out[numel] (float32, float16 or bfloat16) = decode(payload). numel must match.
void decode(const uint8_t* payload, size_t bytes, DataType outType, void* out, size_t numel);
// out[numel] (float32) += decode(payload).
void decodeAccumulate(const uint8_t* payload, size_t bytes, float* out, size_t numel);

}  // namespace ddlcomm::compress
