// Counter-based randomness shared by the CPU (csrc/compress) and CUDA (csrc/cuda) encoders:
// pure functions of (seed, stream, index), so results depend neither on threading nor on the
// device. Keep this header free of anything nvcc's device pass cannot compile.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define DDLCOMM_HOST_DEVICE __host__ __device__
#else
#define DDLCOMM_HOST_DEVICE
#endif

namespace ddlcomm::compress {

// Counter-based random bits: splitmix64 of the three inputs.
DDLCOMM_HOST_DEVICE inline uint64_t counterBits(uint64_t seed, uint64_t stream, uint64_t index) {
  uint64_t z = seed ^ (stream * 0x9e3779b97f4a7c15ull) ^ (index * 0xbf58476d1ce4e5b9ull);
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Counter-based uniform in [0, 1): the top 24 bits of counterBits.
DDLCOMM_HOST_DEVICE inline float counterUniform(uint64_t seed, uint64_t stream, uint64_t index) {
  // Through int32 (exact below 2^24): converting from a signed 32-bit integer vectorizes everywhere.
  return float(int32_t(counterBits(seed, stream, index) >> 40)) * (1.0f / 16777216.0f);
}

// Uniform integer in [0, bound) from 64 random bits: the high half of the 128-bit product.
DDLCOMM_HOST_DEVICE inline uint64_t uniformBelow(uint64_t bits, uint64_t bound) {
#if defined(__CUDA_ARCH__)
  return __umul64hi(bits, bound);
#else
  return uint64_t((unsigned __int128)bits * bound >> 64);
#endif
}

// Random-k's step j of Floyd's algorithm (j = numel-k .. numel-1): the candidate index
// t = uniformBelow(counterBits(seed, stream, j), j + 1); the step takes t, or j itself when t
// was taken by an earlier step.
DDLCOMM_HOST_DEVICE inline uint64_t floydCandidate(uint64_t seed, uint64_t stream, uint64_t j) {
  return uniformBelow(counterBits(seed, stream, j), j + 1);
}

}  // namespace ddlcomm::compress
