// Ternary compression with error feedback, as compress.h defines it. Deterministic (default):
// mean = sum |y| / n, at = mean * kTernaryThreshold, element i is sent iff |y| > at, s = mean
// |y| of the sent elements (s = mean and every element sent when mean is not finite).
// Stochastic (TernGrad): s = max |y| (NaN above +inf); with clip > 0, mean = sum(y) / n,
// var = sum(y*y) / n - mean^2, s = clip * sqrt(max(var, 0)) when that is smaller; element i is
// sent iff counterUniform(seed, stream, i) * s < |y| (or s is not finite). A sent element is
// sign(y) * s. The ternary policy of block_codec.cuh.
#include <cfloat>

#include "cuda/block_codec.cuh"

namespace ddlcomm::gpu::detail {
namespace {

// Warp-collective stochastic scale from the lanes' partial results (all lanes get it).
__device__ __forceinline__ float stochasticScale(uint32_t maxBits, float sum, float squares, uint32_t count,
                                                 float clip) {
  float s = __uint_as_float(warpMaxU32(maxBits));
  if (clip > 0.f) {
    const float n = __uint2float_rn(count);
    const float mean = __fdiv_rn(warpSumContract(sum), n);
    const float var = __fsub_rn(__fdiv_rn(warpSumContract(squares), n), __fmul_rn(mean, mean));
    const float bound = __fmul_rn(clip, __fsqrt_rn(var < 0.f ? 0.f : var));
    if (bound < s) s = bound;  // a NaN bound (non-finite block) clips nothing
  }
  return s;
}

// Codes: 0 -> 0, 1 -> +s, 2 -> -s.
struct TernaryCode {
  static constexpr compress::Format kFormat = compress::Format::Ternary;
  struct Params {
    bool stochastic;
    float thresholdFactor;  // compress::kTernaryThreshold
    float clip;             // 0: off
    uint64_t seed;
    float* thresholds;  // deterministic generic path: each block's threshold (workspace), else null
  };
  struct Scale {
    float s;
    float at;  // the deterministic rule's threshold
  };

  template <class ForEachY>
  static __device__ __forceinline__ Scale blockScale(const Params& f, ForEachY&& forEachY, uint32_t count) {
    if (f.stochastic) {
      uint32_t maxBits = 0;
      float sum = 0.f, squares = 0.f;
      forEachY([&](float y) {
        maxBits = maxOf(maxBits, __float_as_uint(y) & 0x7fffffffu);
        if (f.clip > 0.f) {
          sum = __fadd_rn(sum, y);
          squares = __fadd_rn(squares, __fmul_rn(y, y));
        }
      });
      return {stochasticScale(maxBits, sum, squares, count, f.clip), 0.f};
    }
    float abs = 0.f;
    forEachY([&](float y) { abs = __fadd_rn(abs, fabsf(y)); });
    const float mean = __fdiv_rn(warpSumContract(abs), __uint2float_rn(count));
    const float at = __fmul_rn(mean, f.thresholdFactor);
    float kept = 0.f;
    uint32_t sent = 0;
    forEachY([&](float y) {
      const bool send = fabsf(y) > at;
      kept = __fadd_rn(kept, send ? fabsf(y) : 0.f);
      sent += send;
    });
    const uint32_t sentAll = warpSumU32(sent);
    const float keptAll = warpSumContract(kept);
    return {!(mean <= FLT_MAX) ? mean : sentAll ? __fdiv_rn(keptAll, __uint2float_rn(sentAll)) : 0.f, at};
  }

  static __device__ __forceinline__ void storeScale(float* scales, const Params& f, uint64_t b, Scale s) {
    scales[b] = s.s;
    if (f.thresholds) f.thresholds[b] = s.at;
  }

  static __device__ __forceinline__ Scale loadScale(const float* scales, const Params& f, uint64_t b) {
    return {scales[b], f.thresholds ? f.thresholds[b] : 0.f};
  }

  // A non-finite s sends every element, so the whole block decodes non-finite (the contract's
  // non-finite rule; the deterministic rule's s is non-finite exactly when its mean is).
  static __device__ __forceinline__ uint32_t code(float y, Scale s, const Params& f, uint64_t stream, uint64_t i) {
    const bool send = !(s.s <= FLT_MAX) ||
                      (f.stochastic ? __fmul_rn(compress::counterUniform(f.seed, stream, i), s.s) < fabsf(y)
                                    : fabsf(y) > s.at);
    return send ? (y >= 0.f ? 1u : 2u) : 0u;
  }

  static __device__ __forceinline__ float decode(uint32_t code, Scale s) {
    return code == 1u ? s.s : (code == 2u ? -s.s : 0.f);
  }
};

}  // namespace

size_t ternaryWorkspaceBytes(const compress::Config& config, uint64_t numel) {
  if (config.stochastic || config.blockSize % 4 == 0) return 0;
  return size_t((numel + config.blockSize - 1) / config.blockSize) * sizeof(float);
}

void encodeTernary(const EncodeArgs* a, size_t n) {
  const compress::Config& c = a[0].config;
  // The generic path packs codes in a second kernel, which needs the deterministic threshold
  // (the chunks go one after another on the stream, so they share the workspace).
  float* thresholds = !c.stochastic && c.blockSize % 4 != 0 ? static_cast<float*>(a[0].workspace) : nullptr;
  blocks::encode<TernaryCode>(a, n, {c.stochastic, compress::kTernaryThreshold, c.clip, c.seed, thresholds});
}

void decodeTernary(const DecodeArgs* a, size_t n) { blocks::decode<TernaryCode>(a, n); }

void sumTernary(const DecodeArgs* a, size_t n, float scale, float* out) { blocks::sum<TernaryCode>(a, n, scale, out); }

}  // namespace ddlcomm::gpu::detail
