// Throughput of the CUDA compressors (encode + error feedback, decode-accumulate) next to a
// device-to-device cudaMemcpyAsync of the input, 1 MiB .. 1 GiB of float32 input.
//
//   bench_cuda_kernels [--min-mib=1] [--max-mib=1024] [--only=name] [--reps=N] [--csv=path]
//
// Bandwidth counts bytes read plus bytes written at the minimum a kernel must move:
//   encode+EF: x (4n) + residual read (4n) + residual write (4n) + payload;
//   decode-accumulate: payload + out read and written (8n; sparse formats: 8k);
//   copy: 2 * 4n. "%copy" = kernel bandwidth / copy bandwidth in the same run.
// Times: CUDA events around each call after warm-up, median of the repetitions. Inputs are
// rotated over several buffer sets when one set would fit in L2, so small sizes are not L2 numbers.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "compress/compress.h"
#include "cuda/cuda_check.h"
#include "cuda/cuda_kernels.h"

using namespace ddlcomm;
using compress::Config;
using compress::Format;

namespace {

struct Compressor {
  const char* name;
  Config cfg;
};

std::vector<Compressor> compressors() {
  std::vector<Compressor> list;
  Config c;
  c.format = Format::OneBit;
  list.push_back({"onebit", c});
  c.twoScales = true;
  list.push_back({"onebit-2scale", c});
  c = Config{};
  c.format = Format::Ternary;
  list.push_back({"ternary", c});
  c.stochastic = true;
  c.clip = 2.5f;
  list.push_back({"ternary-stochastic-clip", c});
  c = Config{};
  c.format = Format::TopK;
  c.ratio = 0.01;
  list.push_back({"topk-1%", c});
  c.approximate = true;
  list.push_back({"topk-approx-1%", c});
  c.valueBits = 2;  // SparseLoCo's quantized values
  list.push_back({"topk-approx-1%-2bit", c});
  c.valueBits = 8;
  list.push_back({"topk-approx-1%-8bit", c});
  c = Config{};
  c.format = Format::RandomK;
  c.ratio = 0.01;
  list.push_back({"randomk-1%", c});
  c = Config{};
  c.format = Format::Float16;
  list.push_back({"fp16", c});
  c.format = Format::BFloat16;
  list.push_back({"bf16", c});
  return list;
}

struct Buffer {
  void* p = nullptr;
  explicit Buffer(size_t bytes) {
    if (bytes) DDLCOMM_CUDA_CHECK(cudaMalloc(&p, bytes));
  }
  ~Buffer() {
    if (p) cudaFree(p);
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
};

// Median time in ms of fn(rep) over `reps` calls, each between two events, after 3 warm-ups.
template <typename Fn>
float medianMs(int reps, cudaStream_t s, Fn fn) {
  cudaEvent_t a, b;
  DDLCOMM_CUDA_CHECK(cudaEventCreate(&a));
  DDLCOMM_CUDA_CHECK(cudaEventCreate(&b));
  for (int i = 0; i < 3; ++i) fn(i);
  std::vector<float> t;
  for (int i = 0; i < reps; ++i) {
    DDLCOMM_CUDA_CHECK(cudaEventRecord(a, s));
    fn(i);
    DDLCOMM_CUDA_CHECK(cudaEventRecord(b, s));
    DDLCOMM_CUDA_CHECK(cudaEventSynchronize(b));
    float ms = 0;
    DDLCOMM_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
    t.push_back(ms);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  size_t minMib = 1, maxMib = 1024;
  int reps = 0;
  std::string only, csvPath;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind("--min-mib=", 0) == 0) minMib = std::stoull(a.substr(10));
    else if (a.rfind("--max-mib=", 0) == 0) maxMib = std::stoull(a.substr(10));
    else if (a.rfind("--reps=", 0) == 0) reps = std::stoi(a.substr(7));
    else if (a.rfind("--only=", 0) == 0) only = a.substr(7);
    else if (a.rfind("--csv=", 0) == 0) csvPath = a.substr(6);
    else {
      std::fprintf(stderr, "usage: %s [--min-mib=1] [--max-mib=1024] [--only=name] [--reps=N] [--csv=path]\n", argv[0]);
      return 2;
    }
  }
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("SKIP: no CUDA device\n");
    return 77;
  }
  cudaDeviceProp prop;
  DDLCOMM_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  size_t freeMem = 0, totalMem = 0;
  DDLCOMM_CUDA_CHECK(cudaMemGetInfo(&freeMem, &totalMem));
  std::printf("device: %s, %d SMs, L2 %d MiB, %zu MiB free\n", prop.name, prop.multiProcessorCount,
              prop.l2CacheSize >> 20, freeMem >> 20);
  FILE* csv = csvPath.empty() ? nullptr : std::fopen(csvPath.c_str(), "w");
  if (csv) std::fprintf(csv, "mib,compressor,encode_ms,encode_gbps,encode_pct_copy,decacc_ms,decacc_gbps,decacc_pct_copy,payload_bytes\n");

  cudaStream_t s;
  DDLCOMM_CUDA_CHECK(cudaStreamCreate(&s));
  const auto list = compressors();
  std::printf("%9s %-15s %11s %9s %6s %11s %9s %6s %9s\n", "size", "kernel", "encode us", "GB/s", "%copy",
              "dec-acc us", "GB/s", "%copy", "ratio");
  for (size_t mib = minMib; mib <= maxMib; mib *= 4) {
    const size_t n = mib << 18;  // float32 elements
    const size_t xBytes = 4 * n;
    // Largest payload and workspace over the compressors.
    size_t payCap = 0, wsCap = 0;
    for (const auto& c : list) {
      payCap = std::max(payCap, gpu::encodedBytesCuda(c.cfg, n));
      wsCap = std::max(wsCap, gpu::encodeWorkspaceBytes(c.cfg, DataType::Float32, n));
    }
    const size_t setBytes = 3 * xBytes + payCap;  // x, residual, out, payload
    const size_t sets = std::min<size_t>(64, std::max<size_t>(1, ((size_t(192) << 20) + setBytes - 1) / setBytes));
    if (sets * setBytes + wsCap + xBytes > freeMem * 9 / 10) {
      std::printf("%6zu MiB: skipped, needs %zu MiB of device memory\n", mib, (sets * setBytes + wsCap) >> 20);
      break;
    }
    std::vector<std::unique_ptr<Buffer>> xs, rs, outs, pays;
    std::vector<float> host(n);
    uint64_t z = 0x9e3779b97f4a7c15ull * (mib + 1);
    for (size_t i = 0; i < n; ++i) {
      z = z * 6364136223846793005ull + 1442695040888963407ull;
      host[i] = float(int32_t(z >> 32)) * 4.6566e-10f;  // uniform in (-1, 1): random data, never zeros
    }
    for (size_t k = 0; k < sets; ++k) {
      xs.emplace_back(new Buffer(xBytes));
      rs.emplace_back(new Buffer(xBytes));
      outs.emplace_back(new Buffer(xBytes));
      pays.emplace_back(new Buffer(payCap));
      DDLCOMM_CUDA_CHECK(cudaMemcpy(xs[k]->p, host.data(), xBytes, cudaMemcpyHostToDevice));
      DDLCOMM_CUDA_CHECK(cudaMemset(rs[k]->p, 0, xBytes));
      DDLCOMM_CUDA_CHECK(cudaMemset(outs[k]->p, 0, xBytes));
    }
    Buffer ws(wsCap), copyDst(xBytes);
    const int r = reps > 0 ? reps : (mib >= 256 ? 10 : 30);
    const float copyMs = medianMs(r, s, [&](int i) {
      DDLCOMM_CUDA_CHECK(cudaMemcpyAsync(copyDst.p, xs[i % sets]->p, xBytes, cudaMemcpyDeviceToDevice, s));
    });
    const double copyGbps = 2.0 * xBytes / (copyMs * 1e6);
    std::printf("%6zu MiB %-15s %11.1f %9.1f %6s\n", mib, "d2d-copy", copyMs * 1e3, copyGbps, "100");
    for (const auto& c : list) {
      if (!only.empty() && std::string(c.name).find(only) == std::string::npos) continue;
      const size_t bytes = gpu::encodedBytesCuda(c.cfg, n);
      const float encMs = medianMs(r, s, [&](int i) {
        gpu::encodeCuda(c.cfg, DataType::Float32, xs[i % sets]->p, static_cast<float*>(rs[i % sets]->p), n, i,
                        static_cast<uint8_t*>(pays[i % sets]->p), payCap, ws.p, wsCap, s);
      });
      // Every set holds a payload of this compressor now (warm-up and repetitions cover them).
      for (size_t k = 0; k < sets; ++k)
        gpu::encodeCuda(c.cfg, DataType::Float32, xs[k]->p, static_cast<float*>(rs[k]->p), n, k,
                        static_cast<uint8_t*>(pays[k]->p), payCap, ws.p, wsCap, s);
      // The header fields every encode with this config writes (compress.h, wire_format.h).
      const compress::PayloadInfo info{c.cfg.format, compress::headerFlags(c.cfg), compress::headerBlockSize(c.cfg), n,
                                       compress::keptEntries(c.cfg, n), compress::headerValueBits(c.cfg)};
      const float decMs = medianMs(r, s, [&](int i) {
        gpu::decodeAccumulateCuda(info, static_cast<const uint8_t*>(pays[i % sets]->p), bytes,
                                  static_cast<float*>(outs[i % sets]->p), n, s);
      });
      const bool sparse = info.k > 0;
      const double encBytes = 3.0 * xBytes + bytes;
      const double decBytes = bytes + (sparse ? 8.0 * info.k : 2.0 * xBytes);
      const double encGbps = encBytes / (encMs * 1e6), decGbps = decBytes / (decMs * 1e6);
      std::printf("%6zu MiB %-15s %11.1f %9.1f %6.0f %11.1f %9.1f %6.0f %8.1fx\n", mib, c.name, encMs * 1e3, encGbps,
                  100.0 * encGbps / copyGbps, decMs * 1e3, decGbps, 100.0 * decGbps / copyGbps,
                  double(xBytes) / bytes);
      if (csv)
        std::fprintf(csv, "%zu,%s,%.4f,%.1f,%.1f,%.4f,%.1f,%.1f,%zu\n", mib, c.name, encMs, encGbps,
                     100.0 * encGbps / copyGbps, decMs, decGbps, 100.0 * decGbps / copyGbps, bytes);
    }
    DDLCOMM_CUDA_CHECK(cudaStreamSynchronize(s));
    std::fflush(stdout);
  }
  DDLCOMM_CUDA_CHECK(cudaGetLastError());
  if (csv) std::fclose(csv);
  cudaStreamDestroy(s);
  return 0;
}
