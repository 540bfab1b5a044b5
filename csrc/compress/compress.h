// Compressors with error feedback, on raw CPU buffers (no torch). Each encode is one fused
// pass: y = x + residual; payload = encode(y); residual = y - decode(payload).
//
// Cross-device contract (the CUDA kernels in csrc/cuda/ follow it, so a payload encoded on
// either device is bit-identical for the deterministic formats):
//  - Block sums (1-bit scale = mean |y| of the block, ternary std) are float32 sums taken in
//    32 interleaved lanes (lane j sums elements j, j+32, ... of the block in index order,
//    starting from +0), then combined lane[j] += lane[j+16], +8, +4, +2, +1; no fused
//    multiply-add anywhere. A mean is sum / float(count) (IEEE division). Max is order-free.
//      1-bit:     scale = mean |y|; twoScales: pos = mean of y over {y >= 0}, neg = mean of
//                 |y| over {!(y >= 0)} (NaN counts as negative), 0 for an empty set.
//      ternary:   mean = sum |y| / n; if mean is not finite, s = mean and every element is
//                 sent; else at = mean * kTernaryThreshold (float multiply), element i is sent
//                 iff |y_i| > at, and s = (sum of |y| over the sent elements) / their count
//                 (0 when none is). A sent element has code 1 for y >= 0, else 2.
//      stochastic ternary: s = max |y| (NaN above +inf); with clip > 0: mean = sum(y) / n,
//                 var = sum(y*y) / n - mean*mean, std = sqrt(var < 0 ? 0 : var), and
//                 s = clip*std if clip*std < s (so a NaN std clips nothing). Element i is
//                 sent iff counterUniform(seed, stream, i) * s < |y_i|, or s is not finite.
//      casts:     round to nearest even, overflow to +-inf; NaN stays NaN.
//  - Randomness is counter-based: counterBits / counterUniform(seed, stream, index) in
//    compress/counter_random.h (shared with device code), so results do not depend on
//    threading or device. Random-k takes Floyd's k distinct
//    indices: for j = numel-k .. numel-1, t = (counterBits(seed, stream, j) * (j+1)) >> 64
//    (128-bit product); take t, or j when t is already taken.
//  - Residual: r = y - decoded where that is finite, else 0. A non-finite input makes its
//    block's scale (or its top-k / cast value) non-finite, so the decoded result is
//    non-finite too, and the residual there is reset to 0 so later steps are not poisoned.
//    Random-k carries only its sample, which can miss a non-finite entry; the compressed
//    all-reduce (ddlcomm/compressed.py) checks for that separately.
//  - Top-k keeps the k largest |y| (NaN largest), ties to the lower index; approximate top-k
//    selects exactly the same entries (it only finds them faster, see topk.cc).
//  - Top-k value codes (valueBits b, SparseLoCo's quantized values): the kept entries ranked
//    by |y| as above (rank 0 largest) fall into L = 2^(b-1) magnitude bins of equal count,
//    bin = rank * L / k (integer division); code = bin, plus L when !(y >= 0) (NaN counts as
//    negative). table[c] = float32(sum / count) over the entries with code c, 0 when none has
//    it; the sum in float64 in the block sums' order (lane j sums, in index order, the entries
//    e with e % 32 == j, then the lanes' tree), the division in float64. Each entry decodes to
//    table[its code], so every code's entries keep their sum (up to float32 rounding) and the
//    residual holds the rest; ranks are integers, so the codes are the same on any device.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "common/dtype.h"
#include "compress/counter_random.h"
#include "compress/wire_format.h"

namespace ddlcomm::compress {

// Deterministic ternary: elements above this fraction of the block's mean |y| are sent
// (ternary weight networks, Li et al. 2016: near the squared-error optimum for Gaussian and
// Laplacian blocks).
constexpr float kTernaryThreshold = 0.7f;

struct Config {
  Format format = Format::OneBit;
  uint32_t blockSize = 256;  // 1-bit / ternary: elements per scale
  bool twoScales = false;    // 1-bit SGD variant: one mean for y >= 0, one for y < 0
  bool stochastic = false;   // ternary: TernGrad's stochastic rounding instead of the threshold rule
  float clip = 0.f;          // stochastic ternary: clip y at clip * std(block) before scaling; 0 = off
  double ratio = 0.01;       // top-k / random-k: fraction kept when k == 0
  uint64_t k = 0;            // top-k / random-k: entries kept (overrides ratio)
  bool approximate = false;  // top-k: sampled threshold (Deep Gradient Compression), same result
  bool scaled = false;       // random-k: values times float(double(numel) / k): unbiased estimate
  uint64_t seed = 0;         // stochastic ternary / random-k randomness (top-k sampling)
  unsigned valueBits = 32;   // top-k: 32 sends float32 values; 1, 2, 4 or 8 sends value codes
};

// The header fields that follow from the config alone (shared by the CPU and CUDA encoders).
inline uint8_t headerFlags(const Config& config) {
  const FormatTraits* row = findFormat(uint8_t(config.format));
  const uint8_t asked = (config.twoScales ? kFlagTwoScales : 0) | (config.stochastic ? kFlagStochastic : 0);
  return row == nullptr ? 0 : asked & row->flags;
}
inline uint32_t headerBlockSize(const Config& config) { return hasBlocks(config.format) ? config.blockSize : 0; }
// Value codes are top-k's: 1, 2, 4 or 8 bits; 32 (float32 values) for every format.
inline bool validValueBits(const Config& config) {
  return config.valueBits == 32 ||
         (takesValueCodes(config.format) && config.valueBits > 0 && isValueBits(config.valueBits));
}
inline uint32_t headerValueBits(const Config& config) {
  return takesValueCodes(config.format) && config.valueBits != 32 ? config.valueBits : 0;
}

// Entries kept by top-k / random-k for a vector of numel elements: min(k, numel) when k is
// set, else round(ratio * numel) (half away from zero) clamped to [1, numel]; 0 when numel is 0.
inline uint64_t keptEntries(const Config& config, size_t numel) {
  if (!isSparse(config.format) || numel == 0) return 0;
  if (config.k > 0) return std::min<uint64_t>(config.k, numel);
  const double k = std::round(config.ratio * double(numel));
  return k < 1.0 ? 1 : std::min<uint64_t>(uint64_t(k), numel);
}

// The header and the section layout of every encode of numel elements with this config.
inline PayloadHeader makeHeader(const Config& config, uint64_t numel) {
  PayloadHeader header{};
  header.magic = kPayloadMagic;
  header.version = kPayloadVersion;
  header.format = uint8_t(config.format);
  header.flags = headerFlags(config);
  header.blockSize = headerBlockSize(config);
  header.valueBits = headerValueBits(config);
  header.numel = numel;
  header.k = keptEntries(config, numel);
  return header;
}
inline PayloadLayout payloadLayout(const Config& config, size_t numel) {
  return payloadLayout(config.format, config.twoScales, config.blockSize, numel, keptEntries(config, numel),
                       headerValueBits(config));
}

// Payload size of every encode of numel elements with this config (exact for all formats).
size_t encodedBytes(const Config& config, size_t numel);

// Which path approximate top-k took, counted per encode (for tests and diagnostics: the
// path never changes the payload). Owned by the caller, who passes it to encode(); safe to
// share between threads.
struct TopKStats {
  std::atomic<uint64_t> sampled{0};         // the sampled threshold left k to 4k + 2^15 candidates
  std::atomic<uint64_t> exactFallbacks{0};  // it did not (ties, a poor sample): radix select on y
};

// x: numel elements of xType (float32, float16 or bfloat16). residual: float32[numel] or
// null (no error feedback). stream: distinguishes calls for the counter-based randomness
// (e.g. rank and step). Returns the payload size written into payload[capacity].
// topKStats: counts approximate top-k's paths when not null.
size_t encode(const Config& config, DataType xType, const void* x, float* residual, size_t numel, uint64_t stream,
              uint8_t* payload, size_t capacity, TopKStats* topKStats = nullptr);

struct PayloadInfo {
  Format format;
  uint8_t flags;
  uint32_t blockSize;
  uint64_t numel;
  uint64_t k;
  uint32_t valueBits;  // top-k value codes; 0: float32 values
};
// Validates a payload completely (header, exact size, index order and range, codes);
// throws Error(Protocol) describing the first problem.
PayloadInfo inspect(const uint8_t* payload, size_t bytes);

// Throws Error(Mismatch) unless the payload's header has config's format, block size, flags
// and value bits (a payload shorter than a header: Error(Protocol)). decode() checks only the
// caller's element count; a receiver that knows the config to expect checks it here: float16 and
// bfloat16 payloads, or 1-bit ones with block sizes 250 and 256, can have the same size.
void checkPayloadConfig(const uint8_t* payload, size_t bytes, const Config& config);

// Throws Error(UnsupportedType) unless `type` is one the compressors take (float32, float16,
// bfloat16); `what` names the tensor in the message.
void checkFloatType(DataType type, const char* what);

// out[numel] (float32, float16 or bfloat16) = decode(payload), after inspect(). A numel other
// than the payload's throws Error(InvalidArgument).
void decode(const uint8_t* payload, size_t bytes, DataType outType, void* out, size_t numel);
// out[numel] (float32) += decode(payload).
void decodeAccumulate(const uint8_t* payload, size_t bytes, float* out, size_t numel);

// The reduction step of the compressed all-reduce (1-bit, ternary, casts), fused: encodes
// y = (0 + decode(payloads[0]) + ... + decode(payloads[count-1])) * factor, summed in that
// order in float32 (no multiply for factor 1), with error feedback into residual[numel].
// Writes the same bytes as decodeAccumulate into a zeroed buffer, scaling it and encoding it,
// but tile by tile while the sum is in cache. Every payload (payloadBytes each) is validated
// first: checkPayloadConfig, inspect, and numel. Returns the payload size written into out.
size_t reduceEncode(const Config& config, const uint8_t* const* payloads, size_t count, size_t payloadBytes,
                    size_t numel, float factor, float* residual, uint64_t stream, uint8_t* out, size_t capacity);

// The same for top-k / random-k, decoded instead of re-encoded: out[i] (float32, float16 or
// bfloat16) = (0 + the payloads' values at i, in order) * factor at every index i that some
// payload carries. The rest of out[numel] is left alone: zeroed first, out holds the same
// values as decodeAccumulate of each payload into a zeroed float32 buffer, scaled and cast.
void sumSparse(const Config& config, const uint8_t* const* payloads, size_t count, size_t payloadBytes, size_t numel,
               float factor, DataType outType, void* out);

}  // namespace ddlcomm::compress
