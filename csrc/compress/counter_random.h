// Counter-based randomness shared by the CPU (csrc/compress) and CUDA (csrc/cuda) encoders:
// a pure function of (seed, stream, index), so results depend neither on threading nor on
// the device. Keep this header free of anything nvcc's device pass cannot compile.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define DDLCOMM_HOST_DEVICE __host__ __device__
#else
#define DDLCOMM_HOST_DEVICE
#endif

namespace ddlcomm::compress {

// splitmix64 of the three inputs.
DDLCOMM_HOST_DEVICE inline uint64_t counterBits(uint64_t seed, uint64_t stream, uint64_t index) {
  uint64_t z = seed ^ (stream * 0x9e3779b97f4a7c15ull) ^ (index * 0xbf58476d1ce4e5b9ull);
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  return z;
}

// Counter-based uniform in [0, 1): the top 24 bits of counterBits, exact in float32.
DDLCOMM_HOST_DEVICE inline float counterUniform(uint64_t seed, uint64_t stream, uint64_t index) {
  return float(counterBits(seed, stream, index) >> 40) * (1.0f / 16777216.0f);
}

// Random-k index choice (stratified sampling, exactly `count` distinct indices, strictly
// increasing in j): stratum j is [lo, hi) with lo = floor(j * numel / count),
// hi = floor((j + 1) * numel / count), and index_j = lo + floor((hi - lo) * u_j) with
// u_j = counterUniform(seed, stream, j), computed exactly in integers as
// lo + (((hi - lo) * (counterBits(seed, stream, j) >> 40)) >> 24).
// Requires 1 <= count <= numel < 2^32 (payload indices are uint32), so no product overflows.
DDLCOMM_HOST_DEVICE inline uint64_t stratifiedIndex(uint64_t seed, uint64_t stream, uint64_t j, uint64_t count,
                                                    uint64_t numel) {
  const uint64_t lo = j * numel / count;
  const uint64_t hi = (j + 1) * numel / count;
  return lo + (((hi - lo) * (counterBits(seed, stream, j) >> 40)) >> 24);
}

}  // namespace ddlcomm::compress
