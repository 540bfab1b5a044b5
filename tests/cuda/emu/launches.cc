// How many kernel launches the compressed all-reduce issues on the GPU for one DDP bucket, counted
// on the CPU emulator (each launch, and each stream memset or copy, of csrc/cuda's launchers):
// where no GPU has measured the host's share of a step, the number of operations it enqueues.
//
//   cmake -S tests/cuda/emu -B build/cuda-emu -G Ninja -DDDLCOMM_EMU_ASAN=OFF
//   ninja -C build/cuda-emu cuda_launches_emu && build/cuda-emu/cuda_launches_emu [--bucket-mb=25]
//
// A bucket runs the calls csrc/torch/collective_compressed.cc makes, in its order, over random
// normal gradients. A quantizer or cast at n ranks (one piece, its Piece): the n chunks encoded
// with their residuals (gpu::encodeChunksCuda), the n chunks received summed and scaled
// (gpu::sumPayloadsCuda) and the sum encoded with the server residual, the n chunks gathered
// decoded (gpu::decodeChunksCuda); two NCCL calls (all-to-all, all-gather). A sparse format: one
// encode of the bucket, n decode-accumulates of the payloads gathered, around them two torch
// operations (the accumulator's zero and, averaging over n > 1 ranks, its scaling) and one NCCL
// all-gather (random-k first checks for a non-finite entry, which reads a flag on the host:
// torch's sum, isfinite and fill, an all-reduce). "one call a chunk" counts the launches the
// same bucket took when every chunk was a call of its own (the calls' counts composed), with
// the two torch operations a quantizer's sum then took too.
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

// The launches of one bucket of a quantizer or cast at n ranks, as one rank's Piece makes them.
uint64_t countBucket(const compress::Config& config, size_t numel, int n, std::mt19937& rng) {
  std::normal_distribution<float> normal;
  std::vector<float> host(numel);
  for (float& v : host) v = normal(rng);
  DeviceBuffer x(4 * numel), residual(4 * numel);
  x.upload(host.data(), 4 * numel);
  residual.fill(0);
  std::vector<size_t> begin{0};
  for (int i = 0; i < n; ++i) begin.push_back(begin.back() + numel / size_t(n) + (size_t(i) < numel % size_t(n)));
  const size_t slot = (gpu::encodedBytesCuda(config, begin[1]) + 3) / 4 * 4;
  DeviceBuffer sent(size_t(n) * slot), reduced(slot), server(4 * begin[1]);
  server.fill(0);
  std::vector<gpu::EncodeChunk> chunks;
  std::vector<gpu::DecodeChunk> gathered;
  std::vector<const uint8_t*> received;
  for (int i = 0; i < n; ++i) {
    const size_t len = begin[size_t(i) + 1] - begin[size_t(i)];
    chunks.push_back({x.as<float>() + begin[size_t(i)], residual.as<float>() + begin[size_t(i)], len, uint64_t(i),
                      sent.as() + size_t(i) * slot, slot});
    gathered.push_back({sent.as() + size_t(i) * slot, gpu::encodedBytesCuda(config, len), x.as<float>() + begin[size_t(i)],
                        len});
    received.push_back(sent.as());  // every rank's payload of chunk 0, as rank 0 receives them
  }
  const uint64_t before = emu::operations();
  gpu::encodeChunksCuda(config, DataType::Float32, chunks.data(), chunks.size(), nullptr, 0, nullptr);
  gpu::sumPayloadsCuda(config, received.data(), received.size(), begin[1], 1.f / float(n), x.as<float>(), nullptr);
  gpu::encodeCuda(config, DataType::Float32, x.ptr, server.as<float>(), begin[1], 0, reduced.as(), slot, nullptr, 0,
                  nullptr);
  gpu::decodeChunksCuda(config, gathered.data(), gathered.size(), DataType::Float32, nullptr);
  return emu::operations() - before;
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
  std::printf("A %zu MB float32 bucket (%zu elements): csrc/cuda launches per bucket\n\n", bucketMb, numel);
  std::printf("| compressor | ranks | launches per bucket | + torch ops | + NCCL calls | one call a chunk: "
              "launches + torch ops |\n|---|---|---|---|---|---|\n");
  for (const auto& f : formats) {
    const bool sparse = compress::isSparse(f.config.format);
    for (int n : {1, 2, 4, 8}) {
      // Sparse formats encode the whole bucket and decode every rank's payload of it.
      const Counts c = countCalls(f.config, sparse ? numel : numel / size_t(n), rng);
      const uint64_t perChunk = sparse ? c.encode + uint64_t(n) * c.decodeAccumulate
                                       : uint64_t(n + 1) * c.encode + uint64_t(n) * (c.decodeAccumulate + c.decode);
      const uint64_t perBucket = sparse ? perChunk : countBucket(f.config, numel, n, rng);
      const int torchOps = n > 1 ? 2 : 1;
      const bool checksFinite = f.config.format == compress::Format::RandomK;
      const std::string extra = checksFinite ? " + 3" : "";
      std::printf("| %s | %d | %llu | %d%s | %d%s | %llu + %d%s |\n", f.name, n,
                  static_cast<unsigned long long>(perBucket), sparse ? torchOps : 0, extra.c_str(), sparse ? 1 : 2,
                  checksFinite ? " + 1" : "", static_cast<unsigned long long>(perChunk), torchOps, extra.c_str());
      std::fflush(stdout);
    }
  }
  return 0;
}
