// One rank's GPU work in a compressed all-reduce of a DDP bucket at n ranks (the exchanges left
// out), its chunks taken together as csrc/torch/payload_codec.cc takes them, against each
// chunk a call of its own (the calls before they were taken together; the sum's zero and
// scaling, torch ops then, left out). A quantizer or cast at n ranks: the n chunks encoded with
// their residuals, the n chunks received summed, the sum encoded with the server residual, the
// n chunks gathered decoded.
//
//   bench_cuda_bucket [--bucket-mib=24] [--reps=N]
//
// "host us": the wall time to enqueue the calls (what a step's host spends on them); "GPU us":
// CUDA events around them, the stream idle before. Medians of the repetitions, after warm-up.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "compress/compress.h"
#include "cuda/cuda_check.h"
#include "cuda/cuda_kernels.h"

using namespace ddlcomm;

namespace {

struct Device {
  void* p = nullptr;
  explicit Device(size_t bytes) { DDLCOMM_CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(bytes, 4))); }
  ~Device() { cudaFree(p); }
  Device(const Device&) = delete;
  Device& operator=(const Device&) = delete;
  template <typename T = uint8_t>
  T* as() const {
    return static_cast<T*>(p);
  }
};

// One rank's buffers for a bucket of numel float32 elements at n ranks.
struct Bucket {
  size_t numel;
  int n;
  std::vector<size_t> begin;  // chunk i: [begin[i], begin[i + 1])
  size_t slot;
  Device x, residual, server, sent, received, reduced;

  Bucket(const compress::Config& config, size_t numel_, int n_)
      : numel(numel_),
        n(n_),
        begin(chunkBounds(numel_, n_)),
        slot((gpu::encodedBytesCuda(config, begin[1]) + 3) / 4 * 4),
        x(4 * numel_),
        residual(4 * numel_),
        server(4 * begin[1]),
        sent(size_t(n_) * slot),
        received(size_t(n_) * slot),
        reduced(slot) {
    DDLCOMM_CUDA_CHECK(cudaMemset(x.p, 0x3c, 4 * numel));  // 0.0115 everywhere: finite
    DDLCOMM_CUDA_CHECK(cudaMemset(residual.p, 0, 4 * numel));
    DDLCOMM_CUDA_CHECK(cudaMemset(server.p, 0, 4 * begin[1]));
  }

  static std::vector<size_t> chunkBounds(size_t numel, int n) {
    std::vector<size_t> b{0};
    for (int i = 0; i < n; ++i) b.push_back(b.back() + numel / size_t(n) + (size_t(i) < numel % size_t(n)));
    return b;
  }
  size_t length(int i) const { return begin[size_t(i) + 1] - begin[size_t(i)]; }
  float* chunk(int i) const { return x.as<float>() + begin[size_t(i)]; }
};

// The received chunks in `received` (copies of chunk 0's payload, as the exchange would leave
// equal-length payloads there) and the gathered ones in `sent`.
void together(const compress::Config& config, Bucket& b, cudaStream_t s) {
  std::vector<gpu::EncodeChunk> chunks;
  std::vector<gpu::DecodeChunk> gathered;
  std::vector<const uint8_t*> received;
  for (int i = 0; i < b.n; ++i) {
    chunks.push_back({b.chunk(i), b.residual.as<float>() + b.begin[size_t(i)], b.length(i), uint64_t(i),
                      b.sent.as() + size_t(i) * b.slot, b.slot});
    gathered.push_back({b.sent.as() + size_t(i) * b.slot, gpu::encodedBytesCuda(config, b.length(i)), b.chunk(i),
                        b.length(i)});
    received.push_back(b.received.as() + size_t(i) * b.slot);
  }
  gpu::encodeChunksCuda(config, DataType::Float32, chunks.data(), chunks.size(), nullptr, 0, s);
  gpu::sumPayloadsCuda(config, received.data(), received.size(), b.length(0), 1.f / float(b.n), b.chunk(0), s);
  gpu::encodeCuda(config, DataType::Float32, b.chunk(0), b.server.as<float>(), b.length(0), 0, b.reduced.as(), b.slot,
                  nullptr, 0, s);
  gpu::decodeChunksCuda(config, gathered.data(), gathered.size(), DataType::Float32, s);
}

void oneCallAChunk(const compress::Config& config, Bucket& b, cudaStream_t s) {
  const size_t bytes0 = gpu::encodedBytesCuda(config, b.length(0));
  for (int i = 0; i < b.n; ++i) {
    gpu::encodeCuda(config, DataType::Float32, b.chunk(i), b.residual.as<float>() + b.begin[size_t(i)], b.length(i),
                    uint64_t(i), b.sent.as() + size_t(i) * b.slot, b.slot, nullptr, 0, s);
  }
  for (int i = 0; i < b.n; ++i) {
    gpu::decodeAccumulateCuda(gpu::expectedInfo(config, b.length(0), bytes0), b.received.as() + size_t(i) * b.slot,
                              bytes0, b.chunk(0), b.length(0), s);
  }
  gpu::encodeCuda(config, DataType::Float32, b.chunk(0), b.server.as<float>(), b.length(0), 0, b.reduced.as(), b.slot,
                  nullptr, 0, s);
  for (int i = 0; i < b.n; ++i) {
    const size_t bytes = gpu::encodedBytesCuda(config, b.length(i));
    gpu::decodeCuda(gpu::expectedInfo(config, b.length(i), bytes), b.sent.as() + size_t(i) * b.slot, bytes,
                    DataType::Float32, b.chunk(i), b.length(i), s);
  }
}

struct Times {
  double hostUs, gpuUs;
};

template <typename Fn>
Times timeIt(int reps, cudaStream_t s, Fn fn) {
  cudaEvent_t a, e;
  DDLCOMM_CUDA_CHECK(cudaEventCreate(&a));
  DDLCOMM_CUDA_CHECK(cudaEventCreate(&e));
  std::vector<double> host, gpu;
  for (int r = -3; r < reps; ++r) {
    DDLCOMM_CUDA_CHECK(cudaStreamSynchronize(s));
    DDLCOMM_CUDA_CHECK(cudaEventRecord(a, s));
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    const auto t1 = std::chrono::steady_clock::now();
    DDLCOMM_CUDA_CHECK(cudaEventRecord(e, s));
    DDLCOMM_CUDA_CHECK(cudaEventSynchronize(e));
    float ms = 0;
    DDLCOMM_CUDA_CHECK(cudaEventElapsedTime(&ms, a, e));
    if (r < 0) continue;
    host.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
    gpu.push_back(1e3 * ms);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(e);
  std::sort(host.begin(), host.end());
  std::sort(gpu.begin(), gpu.end());
  return {host[host.size() / 2], gpu[gpu.size() / 2]};
}

}  // namespace

int main(int argc, char** argv) {
  double mib = 24;
  int reps = 50;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind("--bucket-mib=", 0) == 0) {
      mib = std::stod(a.substr(13));
    } else if (a.rfind("--reps=", 0) == 0) {
      reps = std::max(1, std::stoi(a.substr(7)));
    } else {
      std::fprintf(stderr, "usage: %s [--bucket-mib=24] [--reps=N]\n", argv[0]);
      return 2;
    }
  }
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("SKIP: no CUDA device\n");
    return 77;
  }
  const size_t numel = size_t(mib * (1 << 18));
  if (numel < 16) {
    std::fprintf(stderr, "--bucket-mib=%g: fewer float32 elements than the 16 ranks' chunks\n", mib);
    return 2;
  }
  cudaStream_t s;
  DDLCOMM_CUDA_CHECK(cudaStreamCreate(&s));
  const struct {
    const char* name;
    compress::Format format;
  } formats[] = {{"1-bit", compress::Format::OneBit},
                 {"ternary", compress::Format::Ternary},
                 {"fp16", compress::Format::Float16},
                 {"bf16", compress::Format::BFloat16}};
  std::printf("A %g MiB float32 bucket, one rank's kernels at n ranks (%d repetitions)\n\n", mib, reps);
  std::printf("| compressor | ranks | host us, together | host us, one call a chunk | GPU us, together | "
              "GPU us, one call a chunk |\n|---|---|---|---|---|---|\n");
  for (const auto& f : formats) {
    compress::Config config;
    config.format = f.format;
    for (int n : {1, 2, 4, 8, 16}) {
      Bucket b(config, numel, n);
      // Every received payload a valid one: chunk 0 encoded into each slot.
      for (int i = 0; i < n; ++i) {
        gpu::encodeCuda(config, DataType::Float32, b.chunk(0), nullptr, b.length(0), 0,
                        b.received.as() + size_t(i) * b.slot, b.slot, nullptr, 0, s);
      }
      const Times t = timeIt(reps, s, [&] { together(config, b, s); });
      const Times o = timeIt(reps, s, [&] { oneCallAChunk(config, b, s); });
      std::printf("| %s | %d | %.1f | %.1f | %.1f | %.1f |\n", f.name, n, t.hostUs, o.hostUs, t.gpuUs, o.gpuUs);
      std::fflush(stdout);
    }
  }
  DDLCOMM_CUDA_CHECK(cudaStreamSynchronize(s));
  cudaStreamDestroy(s);
  return 0;
}
