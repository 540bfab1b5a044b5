// 1-bit compression with error feedback (single scale = mean |y| per block, or 1-bit SGD's two
// scales: mean of y >= 0 and mean |y| of y < 0): the 1-bit policy of block_codec.cuh.
#include "cuda/block_codec.cuh"

namespace ddlcomm::gpu::detail {
namespace {

template <bool kTwo>
struct Sums {
  float pos = 0.f;  // single scale: sum |y|
  float neg = 0.f;  // two scales: sum |y| over y < 0 (and NaN)
  uint32_t npos = 0;

  __device__ __forceinline__ void add(float y) {
    if (kTwo) {
      if (y >= 0.f) {
        pos = __fadd_rn(pos, y);
        ++npos;
      } else {
        neg = __fadd_rn(neg, fabsf(y));
      }
    } else {
      pos = __fadd_rn(pos, fabsf(y));
    }
  }
};

// Code 1 (y >= 0) decodes to +pos, code 0 to -neg.
template <bool kTwo>
struct OneBitCode {
  static constexpr compress::Format kFormat = compress::Format::OneBit;
  struct Params {};
  struct Scale {
    float pos, neg;
  };

  template <class ForEachY>
  static __device__ __forceinline__ Scale blockScale(const Params&, ForEachY&& forEachY, uint32_t count) {
    Sums<kTwo> s;
    forEachY([&](float y) { s.add(y); });
    const float pos = warpSumContract(s.pos);
    if (!kTwo) {
      const float mean = __fdiv_rn(pos, __uint2float_rn(count));
      return {mean, mean};
    }
    const float neg = warpSumContract(s.neg);
    const uint32_t npos = warpSumU32(s.npos);
    const uint32_t nneg = count - npos;
    return {npos ? __fdiv_rn(pos, __uint2float_rn(npos)) : 0.f, nneg ? __fdiv_rn(neg, __uint2float_rn(nneg)) : 0.f};
  }

  static __device__ __forceinline__ void storeScale(float* scales, const Params&, uint64_t b, Scale s) {
    if (kTwo) {
      scales[2 * b] = s.pos;
      scales[2 * b + 1] = s.neg;
    } else {
      scales[b] = s.pos;
    }
  }

  static __device__ __forceinline__ Scale loadScale(const float* scales, const Params&, uint64_t b) {
    return kTwo ? Scale{scales[2 * b], scales[2 * b + 1]} : Scale{scales[b], scales[b]};
  }

  static __device__ __forceinline__ uint32_t code(float y, Scale, const Params&, uint64_t, uint64_t) {
    return y >= 0.f;
  }
  static __device__ __forceinline__ float decode(uint32_t code, Scale s) { return code ? s.pos : -s.neg; }
};

}  // namespace

void encodeOneBit(const EncodeArgs* a, size_t n) {
  if (a[0].config.twoScales) {
    blocks::encode<OneBitCode<true>>(a, n, {});
  } else {
    blocks::encode<OneBitCode<false>>(a, n, {});
  }
}

void decodeOneBit(const DecodeArgs* a, size_t n) {
  if (a[0].twoScales) {
    blocks::decode<OneBitCode<true>>(a, n);
  } else {
    blocks::decode<OneBitCode<false>>(a, n);
  }
}

void sumOneBit(const DecodeArgs* a, size_t n, float scale, float* out) {
  if (a[0].twoScales) {
    blocks::sum<OneBitCode<true>>(a, n, scale, out);
  } else {
    blocks::sum<OneBitCode<false>>(a, n, scale, out);
  }
}

}  // namespace ddlcomm::gpu::detail
