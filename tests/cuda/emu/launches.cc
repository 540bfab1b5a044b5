// How many kernel launches the compressed all-reduce issues on the GPU for one DDP bucket, counted
// on the CPU emulator (each launch, and each stream memset or copy, of csrc/cuda's launchers):
// where no GPU has measured the host's share of a step, the number of operations it enqueues.
//
//   cmake -S tests/cuda/emu -B build/cuda-emu -G Ninja -DDDLCOMM_EMU_ASAN=OFF
//   ninja -C build/cuda-emu cuda_launches_emu && build/cuda-emu/cuda_launches_emu [--bucket-mb=25]
//
// A bucket of a quantizer or cast at n ranks (one piece, csrc/torch/collective_compressed.cc's
// Piece): n encodes of a chunk with its residual, n decode-accumulates of the chunks received and
// the encode of their sum with the server residual, n decodes of the chunks gathered; around them
// two torch operations (the accumulator's zero and, averaging over n > 1 ranks, its scaling) and
// two NCCL calls (all-to-all, all-gather). A sparse format: one encode of the bucket, n
// decode-accumulates, the same two torch operations, one NCCL all-gather (random-k first checks
// for a non-finite entry, which reads a flag on the host: torch's sum, isfinite and fill, an
// all-reduce). Counted with random normal gradients.
#include <cuda_runtime.h>  // the emulator's: emu::operations()

#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "compress/compress.h"
#include "cuda/cuda_kernels.h"
#include "harness.h"

using namespace ddlcomm;
using ddlcomm::cuda_test::DeviceBuffer;

namespace {

struct Counts {
  uint64_t encode = 0, decodeAccumulate = 0, decode = 0;
};

// The launches of one encode (with a residual), decode-accumulate and decode of `numel` elements.
Counts countCalls(const compress::Config& config, size_t numel, std::mt19937& rng) {
  std::normal_distribution<float> normal;
  std::vector<float> host(numel);
  for (float& v : host) v = normal(rng);
  DeviceBuffer x(4 * numel), residual(4 * numel), out(4 * numel);
  x.upload(host.data(), 4 * numel);
  residual.fill(0);
  const size_t capacity = (gpu::encodedBytesCuda(config, numel) + 3) / 4 * 4;
  const size_t scratch = gpu::encodeWorkspaceBytes(config, DataType::Float32, numel);
  DeviceBuffer payload(capacity), workspace(scratch);
  Counts c;
  uint64_t before = emu::operations();
  const size_t bytes = gpu::encodeCuda(config, DataType::Float32, x.ptr, residual.as<float>(), numel, 7,
                                       payload.as(), capacity, workspace.ptr, scratch, nullptr);
  c.encode = emu::operations() - before;
  const compress::PayloadInfo info = gpu::expectedInfo(config, numel, bytes);
  before = emu::operations();
  gpu::decodeAccumulateCuda(info, payload.as(), bytes, out.as<float>(), numel, nullptr);
  c.decodeAccumulate = emu::operations() - before;
  before = emu::operations();
  gpu::decodeCuda(info, payload.as(), bytes, DataType::Float32, out.ptr, numel, nullptr);
  c.decode = emu::operations() - before;
  return c;
}

compress::Config configOf(compress::Format format, bool approximate = false) {
  compress::Config c;
  c.format = format;
  c.approximate = approximate;
  return c;
}

}  // namespace

int main(int argc, char** argv) {
  size_t bucketMb = 25;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind("--bucket-mb=", 0) == 0) {
      bucketMb = std::stoul(a.substr(12));
    } else {
      std::fprintf(stderr, "usage: %s [--bucket-mb=25]\n", argv[0]);
      return 2;
    }
  }
  const size_t numel = (bucketMb << 20) / 4;  // float32, as DDP's bucket_cap_mb counts
  const struct {
    const char* name;
    compress::Config config;
  } formats[] = {{"1-bit", configOf(compress::Format::OneBit)},
                 {"ternary", configOf(compress::Format::Ternary)},
                 {"top-k 1%", configOf(compress::Format::TopK)},
                 {"top-k 1% approximate", configOf(compress::Format::TopK, true)},
                 {"random-k 1%", configOf(compress::Format::RandomK)},
                 {"fp16", configOf(compress::Format::Float16)},
                 {"bf16", configOf(compress::Format::BFloat16)}};
  std::mt19937 rng(1);
  std::printf("A %zu MB float32 bucket (%zu elements): csrc/cuda launches per call and per bucket\n\n", bucketMb,
              numel);
  std::printf("| compressor | ranks | encode | decode-accumulate | decode | launches per bucket | "
              "+ torch ops | + NCCL calls |\n|---|---|---|---|---|---|---|---|\n");
  for (const auto& f : formats) {
    const bool sparse = compress::isSparse(f.config.format);
    for (int n : {1, 2, 4, 8}) {
      // Sparse formats encode the whole bucket and decode every rank's payload of it.
      const Counts c = countCalls(f.config, sparse ? numel : numel / size_t(n), rng);
      const uint64_t perBucket = sparse ? c.encode + uint64_t(n) * c.decodeAccumulate
                                        : uint64_t(n + 1) * c.encode + uint64_t(n) * (c.decodeAccumulate + c.decode);
      const bool checksFinite = f.config.format == compress::Format::RandomK;
      std::printf("| %s | %d | %llu | %llu | %llu | %llu | %d%s | %d%s |\n", f.name, n,
                  static_cast<unsigned long long>(c.encode), static_cast<unsigned long long>(c.decodeAccumulate),
                  static_cast<unsigned long long>(c.decode), static_cast<unsigned long long>(perBucket),
                  n > 1 ? 2 : 1, checksFinite ? " + 3" : "", sparse ? 1 : 2, checksFinite ? " + 1" : "");
      std::fflush(stdout);
    }
  }
  return 0;
}
