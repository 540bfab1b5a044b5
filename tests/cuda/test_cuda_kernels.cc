// GPU test of csrc/cuda against host references: the scalar contract model (reference.cc)
// and, when csrc/compress/*.cc exists, the CPU compressors themselves (DDLCOMM_TEST_CPU_COMPRESS). Host code only: it calls the launchers
// of cuda_kernels.h and the CUDA runtime, so it also runs on the CPU emulator (tests/cuda/emu).
//
//   test_cuda_kernels [--quick] [--large] [--sizes=0,1,255] [--seed=N] [--filter=text] [--verbose]
//
// Prints "N passed, M failed" last; exit 0 when all pass, 1 on a failure, 77 without a GPU.
// Made for compute-sanitizer too: every buffer is an exact-size cudaMalloc, outputs are
// poisoned before each call and checked completely afterwards.
//
// test_compression.cc holds the encoders' and decoders' group, this file the argument checks,
// 64-bit indexing and main; harness.{h,cc} holds what they share.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include "common/error.h"
#include "common/half.h"
#include "compress/compress.h"
#include "cuda/cuda_kernels.h"
#include "harness.h"
#include "reference.h"

using namespace ddlcomm;
using namespace ddlcomm::cuda_test;
using compress::Config;
using compress::Format;

namespace {

// ---- argument checks --------------------------------------------------------------------------
void expectError(const std::string& name, ErrorKind kind, const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    check(e.kind() == kind, name, str("wrong error kind: ", e.what()));
    return;
  }
  check(false, name, "no exception");
}

void testErrors(cudaStream_t s) {
  Config c;
  const size_t n = 1000;
  DeviceBuffer x(4 * n), pay(4096), ws(1 << 20);
  expectError("encode: capacity too small", ErrorKind::InvalidArgument,
              [&] { gpu::encodeCuda(c, DataType::Float32, x.ptr, nullptr, n, 0, pay.as(), 40, nullptr, 0, s); });
  expectError("encode: unaligned payload", ErrorKind::InvalidArgument,
              [&] { gpu::encodeCuda(c, DataType::Float32, x.ptr, nullptr, n, 0, pay.as() + 1, 4000, nullptr, 0, s); });
  expectError("encode: int32 input", ErrorKind::UnsupportedType,
              [&] { gpu::encodeCuda(c, DataType::Int32, x.ptr, nullptr, n, 0, pay.as(), 4096, nullptr, 0, s); });
  c.blockSize = 0;
  expectError("encode: block size 0", ErrorKind::InvalidArgument,
              [&] { gpu::encodeCuda(c, DataType::Float32, x.ptr, nullptr, n, 0, pay.as(), 4096, nullptr, 0, s); });
  c = Config{};
  c.format = Format::TopK;
  expectError("encode: top-k without workspace", ErrorKind::InvalidArgument,
              [&] { gpu::encodeCuda(c, DataType::Float32, x.ptr, nullptr, n, 0, pay.as(), 4096, nullptr, 0, s); });
  c.ratio = 1.5;
  expectError("encode: top-k ratio > 1", ErrorKind::InvalidArgument,
              [&] { gpu::encodeCuda(c, DataType::Float32, x.ptr, nullptr, n, 0, pay.as(), 4096, ws.ptr, 1 << 20, s); });
  c.ratio = 0.01;
  c.valueBits = 3;
  expectError("encode: top-k value bits 3", ErrorKind::InvalidArgument,
              [&] { gpu::encodeCuda(c, DataType::Float32, x.ptr, nullptr, n, 0, pay.as(), 4096, ws.ptr, 1 << 20, s); });
  c.format = Format::RandomK;
  c.valueBits = 2;  // value codes are top-k's
  expectError("encode: random-k value bits", ErrorKind::InvalidArgument,
              [&] { gpu::encodeCuda(c, DataType::Float32, x.ptr, nullptr, n, 0, pay.as(), 4096, ws.ptr, 1 << 20, s); });
  expectError("decode: value bits 3", ErrorKind::Protocol, [&] {
    const compress::PayloadInfo coded{Format::TopK, 0, 0, n, 10, 3};
    gpu::decodeCuda(coded, pay.as(), 32 + 40 + 32 + 4, DataType::Float32, x.ptr, n, s);
  });
  expectError("decode: value codes, wrong size", ErrorKind::Protocol, [&] {
    const compress::PayloadInfo coded{Format::TopK, 0, 0, n, 10, 2};
    gpu::decodeCuda(coded, pay.as(), 32 + 40 + 16 + 2, DataType::Float32, x.ptr, n, s);
  });
  c = Config{};
  compress::PayloadInfo info{Format::OneBit, 0, 256, n, 0, 0};
  const size_t bytes = gpu::encodedBytesCuda(c, n);
  expectError("decode: numel mismatch", ErrorKind::InvalidArgument,
              [&] { gpu::decodeCuda(info, pay.as(), bytes, DataType::Float32, x.ptr, n - 1, s); });
  expectError("decode: size mismatch", ErrorKind::Protocol,
              [&] { gpu::decodeCuda(info, pay.as(), bytes + 1, DataType::Float32, x.ptr, n, s); });
  expectError("decode: int output", ErrorKind::UnsupportedType,
              [&] { gpu::decodeCuda(info, pay.as(), bytes, DataType::Int32, x.ptr, n, s); });
}

// ---- more than 2^31 elements: 64-bit indexing ---------------------------------------------------
void testLarge(std::mt19937_64& rng, cudaStream_t s) {
  const size_t n = (size_t(1) << 31) + 77;
  std::printf("large: n = %zu\n", n);
  {  // 1-bit encode of bfloat16 x with a residual; selected blocks checked against the model.
    Config c;
    c.twoScales = true;
    std::vector<uint16_t> x(n);
    uint64_t z = rng();
    for (size_t i = 0; i < n; ++i) {
      z = z * 6364136223846793005ull + 1442695040888963407ull;
      x[i] = floatToBf16(float(int32_t(z >> 32)) * 1e-9f);
    }
    const float r0 = 0.25f;
    DeviceBuffer dx(2 * n), dr(4 * n);
    dx.upload(x.data(), 2 * n);
    {
      std::vector<float> r(n, r0);
      dr.upload(r.data(), 4 * n);
    }
    const size_t bytes = gpu::encodedBytesCuda(c, n);
    DeviceBuffer dp(bytes);
    gpu::encodeCuda(c, DataType::BFloat16, dx.ptr, dr.as<float>(), n, 0, dp.as(), bytes, nullptr, 0, s);
    DDLCOMM_CUDA_CHECK(cudaStreamSynchronize(s));
    std::vector<uint8_t> payload(bytes);
    dp.download(payload.data(), bytes);
    const uint64_t nb = (n + 255) / 256;
    const size_t signsAt = 32 + 8 * nb;
    bool ok = true;
    std::string detail;
    for (uint64_t b : {uint64_t(0), uint64_t(1), (uint64_t(1) << 31) / 256 - 1, (uint64_t(1) << 31) / 256, nb - 2, nb - 1}) {
      const uint64_t base = b * 256;
      const uint32_t count = uint32_t(std::min<uint64_t>(256, n - base));
      std::vector<float> y(count), res(count), got(count);
      for (uint32_t e = 0; e < count; ++e) y[e] = bf16ToFloat(x[base + e]) + r0;
      float scales[2];
      std::vector<uint8_t> bits;
      ref::onebitBlock(y.data(), count, true, scales, bits, res.data());
      DDLCOMM_CUDA_CHECK(cudaMemcpy(got.data(), dr.as<float>() + base, 4 * count, cudaMemcpyDeviceToHost));
      float gs[2];
      std::memcpy(gs, &payload[32 + 8 * b], 8);
      if (std::memcmp(gs, scales, 8) != 0) {
        ok = false;
        detail = str("scales of block ", b);
      }
      for (uint32_t e = 0; e < count; ++e) {
        const uint64_t i = base + e;
        if (((payload[signsAt + i / 8] >> (i % 8)) & 1) != bits[e]) {
          ok = false;
          detail = str("sign of element ", i);
        }
      }
      if (firstDifference(got.data(), res.data(), count, DataType::Float32) >= 0) {
        ok = false;
        detail = str("residual in block ", b);
      }
    }
    check(ok, "large: onebit2 bfloat16 encode (blocks around 2^31 and at the end)", detail);
  }
}

std::vector<size_t> parseSizes(const std::string& s) {
  std::vector<size_t> out;
  std::stringstream in(s);
  std::string item;
  while (std::getline(in, item, ',')) out.push_back(std::stoull(item));
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  Options opt;
  opt.seed = uint64_t(std::chrono::high_resolution_clock::now().time_since_epoch().count());
  std::string sizes;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--quick") opt.quick = true;
    else if (a == "--large") opt.large = true;
    else if (a == "--verbose") opt.verbose = true;
    else if (a.rfind("--sizes=", 0) == 0) sizes = a.substr(8);
    else if (a.rfind("--seed=", 0) == 0) opt.seed = std::stoull(a.substr(7));
    else if (a.rfind("--filter=", 0) == 0) opt.filter = a.substr(9);
    else {
      std::fprintf(stderr, "usage: %s [--quick] [--large] [--sizes=a,b,...] [--seed=N] [--filter=text] [--verbose]\n",
                   argv[0]);
      return 2;
    }
  }
  opt.sizes = !sizes.empty() ? parseSizes(sizes)
              : opt.quick   ? std::vector<size_t>{0, 1, 255, 257, 4099}
                            : std::vector<size_t>{0, 1, 7, 33, 255, 256, 257, 1000, 4099, 65537, 1048579};

  int devices = 0;
  const cudaError_t err = cudaGetDeviceCount(&devices);
  if (err != cudaSuccess || devices == 0) {
    std::printf("SKIP: no CUDA device (%s); nothing tested\n", err != cudaSuccess ? cudaGetErrorString(err) : "0 devices");
    return 77;
  }
  cudaDeviceProp prop;
  DDLCOMM_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s (sm_%d%d), seed %llu (rerun with --seed=%llu)\n", prop.name, prop.major, prop.minor,
              (unsigned long long)opt.seed, (unsigned long long)opt.seed);
#if DDLCOMM_TEST_CPU_COMPRESS
  std::printf("comparing with the CPU compressors (csrc/compress) and the contract model\n");
#else
  std::printf("csrc/compress/*.cc not found at build time: comparing with the contract model only\n");
#endif
  std::mt19937_64 rng(opt.seed);
  cudaStream_t s;
  DDLCOMM_CUDA_CHECK(cudaStreamCreate(&s));
  try {
    testErrors(s);
    testCompression(opt, rng, s);
    if (opt.large) testLarge(rng, s);
  } catch (const std::exception& e) {
    check(false, "unexpected exception", e.what());
  }
  cudaStreamDestroy(s);
  std::printf("%d passed, %d failed\n", g_passed, g_failed);
  return g_failed ? 1 : 0;
}