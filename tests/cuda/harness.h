// What the GPU test's groups share: options, the pass/fail tally, exact-size device buffers
// and bitwise comparisons (NaN-tolerant) of arrays and payloads.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "cuda/cuda_check.h"

namespace ddlcomm::cuda_test {

struct Options {
  bool quick = false, large = false, verbose = false;
  std::vector<size_t> sizes;
  uint64_t seed = 0;
  std::string filter;
};


extern int g_passed, g_failed;

void check(bool ok, const std::string& name, const std::string& detail = "");

template <typename... Args>
std::string str(const Args&... args) {
  std::ostringstream out;
  (out << ... << args);
  return out.str();
}

// Exact-size device buffer.
struct DeviceBuffer {
  void* ptr = nullptr;
  size_t bytes = 0;
  explicit DeviceBuffer(size_t n) : bytes(n) {
    if (n) DDLCOMM_CUDA_CHECK(cudaMalloc(&ptr, n));
  }
  ~DeviceBuffer() {
    if (ptr) cudaFree(ptr);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  template <typename T = uint8_t>
  T* as() const {
    return static_cast<T*>(ptr);
  }
  void upload(const void* src, size_t n) {
    if (n) DDLCOMM_CUDA_CHECK(cudaMemcpy(ptr, src, n, cudaMemcpyHostToDevice));
  }
  void download(void* dst, size_t n) const {
    if (n) DDLCOMM_CUDA_CHECK(cudaMemcpy(dst, ptr, n, cudaMemcpyDeviceToHost));
  }
  void fill(int byte) {
    if (bytes) DDLCOMM_CUDA_CHECK(cudaMemset(ptr, byte, bytes));
  }
};

constexpr int kPoison = 0x5a;  // 0x5a5a5a5a / 0x5a5a are finite in float32, float16 and bfloat16

// First differing element of two arrays of `type`, or -1. Bitwise, except that any two NaNs
// are equal: NaN payload bits are not part of the contract, x86 propagates input payloads
// where GPUs produce a canonical NaN.
long long firstDifference(const void* a, const void* b, size_t n, DataType type);
void checkArrays(const std::string& name, const void* got, const void* want, size_t n, DataType type);
// Payload bytes, section by section (float sections NaN-tolerant, everything else exact);
// empty when equal, else where they differ.
std::string comparePayloads(const std::vector<uint8_t>& got, const std::vector<uint8_t>& want);

// The test groups, one file each.
void testCompression(const Options& opt, std::mt19937_64& rng, cudaStream_t s);  // test_compression.cc

}  // namespace ddlcomm::cuda_test
