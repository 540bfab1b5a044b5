// Every compressor format, configuration, input dtype and data shape, encoded on the GPU and
// compared byte for byte with the contract model (reference.cc) and, when built with
// csrc/compress, with the CPU compressors; then every decoder and decodeAccumulate.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <exception>

#include "compress/compress.h"
#include "cuda/cuda_kernels.h"
#include "harness.h"
#include "reference.h"

namespace ddlcomm::cuda_test {

using compress::Config;
using compress::Format;

namespace {

enum class Data { Normal, Ties, NonFinite };
const char* dataName(Data d) { return d == Data::Normal ? "normal" : d == Data::Ties ? "ties" : "nonfinite"; }

std::vector<float> makeValues(size_t n, Data mode, std::mt19937_64& rng, float scale) {
  std::normal_distribution<float> normal(0.f, scale);
  std::uniform_int_distribution<int> small(-2, 2);
  std::uniform_real_distribution<float> unit(0.f, 1.f);
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) {
    if (mode == Data::Ties) {
      v[i] = float(small(rng)) * scale;
      continue;
    }
    const float u = unit(rng);
    if (u < 0.03f) {
      v[i] = 0.f;
    } else if (u < 0.04f) {
      v[i] = -0.f;
    } else if (u < 0.08f && i > 0) {
      v[i] = -v[i / 2];  // duplicate magnitudes: ties in top-k
    } else {
      v[i] = normal(rng);
    }
  }
  if (mode == Data::NonFinite && n > 0) {
    const float specials[] = {NAN, INFINITY, -INFINITY, 3e38f, -3e38f};
    const size_t count = std::max<size_t>(1, n / 300);
    for (size_t j = 0; j < count; ++j) v[rng() % n] = specials[rng() % 5];
  }
  return v;
}

std::vector<uint8_t> toType(const std::vector<float>& v, DataType t) {
  std::vector<uint8_t> out(v.size() * elementSize(t));
  for (size_t i = 0; i < v.size(); ++i) ref::storeFromFloat(t, out.data(), i, v[i]);
  return out;
}

// ---- compression ---------------------------------------------------------------------------
struct Case {
  std::string name;
  Config cfg;
  bool scaled = false;  // random-k values times numel / k (Config::scaled)
  int slow = 0;  // many launches per encode: with --quick (the CPU emulator's run) 1: one size and input only, 2: none
};

std::vector<Case> compressionCases() {
  std::vector<Case> cases;
  auto add = [&](const std::string& name, Config c) { cases.push_back({name, c}); };
  Config c;
  c.format = Format::OneBit;
  for (uint32_t bs : {256u, 32u, 1000u, 8u, 100u, 5u}) {
    c.blockSize = bs;
    c.twoScales = false;
    add(str("onebit bs=", bs), c);
    c.twoScales = true;
    add(str("onebit2 bs=", bs), c);
  }
  c = Config{};
  c.format = Format::Ternary;
  for (uint32_t bs : {256u, 36u, 512u, 6u}) {
    c.blockSize = bs;
    add(str("ternary bs=", bs), c);
  }
  c.stochastic = true;
  c.seed = 1234;
  for (uint32_t bs : {256u, 36u, 512u, 6u}) {
    for (float clip : {0.f, 2.5f}) {
      c.blockSize = bs;
      c.clip = clip;
      add(str("ternary-stochastic bs=", bs, " clip=", clip), c);
    }
  }
  c = Config{};
  c.format = Format::TopK;
  for (bool approx : {false, true}) {
    c.approximate = approx;
    const std::string kind = approx ? "topk-approx" : "topk";
    c.k = 0;
    c.ratio = 0.01;
    add(kind + " ratio=0.01", c);
    c.ratio = 0.3;
    add(kind + " ratio=0.3", c);
    c.k = 1;
    add(kind + " k=1", c);
    c.k = uint64_t(1) << 40;
    add(kind + " k=all", c);
    c.k = 0;
    for (unsigned bits : {1u, 2u, 4u, 8u}) {  // value codes (SparseLoCo's quantized values)
      c.valueBits = bits;
      c.ratio = bits == 1 || bits == 4 ? 0.3 : 0.05;  // 8 bits: often fewer entries than bins
      cases.push_back({str(kind, " ratio=", c.ratio, " bits=", bits), c, false, bits > 2 ? 1 : 0});
    }
    c.k = 3;  // two bin starts, of 64 and 21 bins; empty codes
    cases.push_back({kind + " k=3 bits=8", c, false, 1});
    c.k = 300;  // 127 bin starts where there are enough entries (k = numel below 300)
    cases.push_back({kind + " k=300 bits=8", c, false, 2});
    c.valueBits = 32;
  }
  c = Config{};
  c.format = Format::RandomK;
  c.seed = 99;
  for (double ratio : {0.05, 0.5}) {
    c.ratio = ratio;
    add(str("randomk ratio=", ratio), c);
  }
  c.k = 3;
  add("randomk k=3", c);
  c.k = uint64_t(1) << 40;
  add("randomk k=all", c);
  c.k = 0;
  c.ratio = 0.05;
  c.scaled = true;
  cases.push_back({"randomk-scaled ratio=0.05", c, true});
  c = Config{};
  c.format = Format::Float16;
  add("fp16", c);
  c.format = Format::BFloat16;
  add("bf16", c);
  return cases;
}

struct Variant {
  DataType xType;
  bool ef;
  Data data;
};

void testEncodeOnce(const Case& cs, size_t n, const Variant& v, uint64_t stream, std::mt19937_64& rng,
                    cudaStream_t cudaStream, bool verbose) {
  const Config& cfg = cs.cfg;
  const std::string name = str(cs.name, " x=", dataTypeName(v.xType), " n=", n, " ef=", v.ef, " ", dataName(v.data));
  if (verbose) std::printf("  %s\n", name.c_str());
  const std::vector<uint8_t> x = toType(makeValues(n, v.data, rng, 1.f), v.xType);
  std::vector<float> residual0 = makeValues(n, v.data == Data::NonFinite ? Data::Normal : v.data, rng, 0.1f);

  // Device run. Payload and residual buffers are exact-size; the payload gets 64 guard bytes.
  const size_t bytes = gpu::encodedBytesCuda(cfg, n);
  const size_t capacity = bytes + 64;
  const size_t wsBytes = gpu::encodeWorkspaceBytes(cfg, v.xType, n);
  DeviceBuffer dx(x.size()), dres(v.ef ? 4 * n : 0), dpay(capacity), dws(wsBytes);
  dx.upload(x.data(), x.size());
  dres.upload(residual0.data(), 4 * n * v.ef);
  dpay.fill(kPoison);
  dws.fill(0xcd);  // the encoder must initialize what it uses
  size_t written = 0;
  try {
    written = gpu::encodeCuda(cfg, v.xType, dx.ptr, v.ef ? dres.as<float>() : nullptr, n, stream, dpay.as(),
                              capacity, dws.ptr, wsBytes, cudaStream);
    DDLCOMM_CUDA_CHECK(cudaStreamSynchronize(cudaStream));
  } catch (const std::exception& e) {
    check(false, name + ": encode", e.what());
    return;
  }
  check(written == bytes, name + ": returned size", str(written, " vs ", bytes));
  std::vector<uint8_t> payload(capacity);
  dpay.download(payload.data(), capacity);
  std::vector<float> residual(v.ef ? n : 0);
  dres.download(residual.data(), 4 * residual.size());
  bool guardIntact = true;
  for (size_t i = bytes; i < capacity; ++i) guardIntact &= payload[i] == kPoison;
  check(guardIntact, name + ": no write past the payload");
  payload.resize(bytes);

  // Scalar contract model.
  std::vector<float> refResidual = residual0;
  const std::vector<uint8_t> refPayload =
      ref::encode(cfg, v.xType, x.data(), v.ef ? refResidual.data() : nullptr, n, stream, cs.scaled);
  check(ref::keptEntries(cfg, n) == compress::keptEntries(cfg, n), name + ": keptEntries");
  const std::string diff = comparePayloads(payload, refPayload);
  check(diff.empty(), name + ": payload vs model", diff);
  if (v.ef) checkArrays(name + ": residual vs model", residual.data(), refResidual.data(), n, DataType::Float32);

#if DDLCOMM_TEST_CPU_COMPRESS
  {  // The CPU implementation: same sizes, same bytes, accepts the GPU payload.
    const size_t cpuBound = compress::encodedBytes(cfg, n);
    const bool approx = cfg.format == Format::TopK && cfg.approximate;
    check(approx ? cpuBound >= bytes : cpuBound == bytes, name + ": encodedBytes vs CPU", str(cpuBound, " vs ", bytes));
    std::vector<float> cpuResidual = residual0;
    std::vector<uint8_t> cpuPayload(std::max(cpuBound, bytes));
    try {
      const size_t got = compress::encode(cfg, v.xType, x.data(), v.ef ? cpuResidual.data() : nullptr, n, stream,
                                          cpuPayload.data(), cpuPayload.size());
      cpuPayload.resize(got);
      if (!approx) {  // approximate top-k: the CPU may keep fewer entries (contract: k' <= k)
        const std::string cpuDiff = comparePayloads(payload, cpuPayload);
        check(cpuDiff.empty(), name + ": payload vs CPU", cpuDiff);
        if (v.ef) checkArrays(name + ": residual vs CPU", residual.data(), cpuResidual.data(), n, DataType::Float32);
      }
      compress::inspect(payload.data(), payload.size());
      check(true, name + ": CPU inspect accepts the GPU payload");
    } catch (const std::exception& e) {
      check(false, name + ": CPU encode/inspect", e.what());
    }
  }
#endif

  // Decoders: every output type, and accumulate; outputs poisoned first.
  compress::PayloadInfo info{};
  info.format = Format(payload[5]);
  info.flags = payload[6];
  std::memcpy(&info.blockSize, &payload[8], 4);
  std::memcpy(&info.valueBits, &payload[12], 4);
  std::memcpy(&info.numel, &payload[16], 8);
  std::memcpy(&info.k, &payload[24], 8);
  DeviceBuffer dp(bytes);
  dp.upload(payload.data(), bytes);  // exact-size copy: any read past the payload is caught
  for (DataType out : {DataType::Float32, DataType::Float16, DataType::BFloat16}) {
    const size_t es = elementSize(out);
    DeviceBuffer dout(n * es);
    dout.fill(kPoison);
    std::vector<uint8_t> got(n * es), want(n * es);
    try {
      gpu::decodeCuda(info, dp.as(), bytes, out, dout.ptr, n, cudaStream);
      DDLCOMM_CUDA_CHECK(cudaStreamSynchronize(cudaStream));
    } catch (const std::exception& e) {
      check(false, name + ": decode", e.what());
      continue;
    }
    dout.download(got.data(), got.size());
    ref::decode(payload.data(), bytes, out, want.data(), n);
    checkArrays(name + ": decode to " + dataTypeName(out), got.data(), want.data(), n, out);
#if DDLCOMM_TEST_CPU_COMPRESS
    std::vector<uint8_t> cpu(n * es);
    compress::decode(payload.data(), bytes, out, cpu.data(), n);
    checkArrays(name + ": decode vs CPU to " + dataTypeName(out), got.data(), cpu.data(), n, out);
#endif
  }
  {
    std::vector<float> acc = makeValues(n, Data::Normal, rng, 1.f);
    DeviceBuffer dout(4 * n);
    dout.upload(acc.data(), 4 * n);
    std::vector<float> got(n), want = acc;
    try {
      gpu::decodeAccumulateCuda(info, dp.as(), bytes, dout.as<float>(), n, cudaStream);
      DDLCOMM_CUDA_CHECK(cudaStreamSynchronize(cudaStream));
      dout.download(got.data(), 4 * n);
      ref::decodeAccumulate(payload.data(), bytes, want.data(), n);
      checkArrays(name + ": decodeAccumulate", got.data(), want.data(), n, DataType::Float32);
#if DDLCOMM_TEST_CPU_COMPRESS
      std::vector<float> cpu = acc;
      compress::decodeAccumulate(payload.data(), bytes, cpu.data(), n);
      checkArrays(name + ": decodeAccumulate vs CPU", got.data(), cpu.data(), n, DataType::Float32);
#endif
    } catch (const std::exception& e) {
      check(false, name + ": decodeAccumulate", e.what());
    }
  }
}

// ---- several chunks a call ---------------------------------------------------------------
// encodeChunksCuda, decodeChunksCuda and sumPayloadsCuda against the single calls, chunk by
// chunk: `total` elements in n chunks of ring sizes (some empty where total < n), their
// payloads in slots of one size, as an all-gather leaves them; 17 chunks take two tables of
// kMaxParts. The sum: n payloads of chunk 0's size, against decodeAccumulateCuda of each
// from 0, times the scale.
void testChunks(const Case& cs, size_t total, size_t n, uint64_t stream, std::mt19937_64& rng, cudaStream_t s) {
  const Config& cfg = cs.cfg;
  const std::string name = str(cs.name, " chunks=", n, " total=", total);
  std::vector<size_t> begin{0}, bytes;
  size_t slot = 0, wsBytes = 0;
  for (size_t i = 0; i < n; ++i) {
    const size_t len = total / n + (i < total % n ? 1 : 0);
    begin.push_back(begin.back() + len);
    bytes.push_back(gpu::encodedBytesCuda(cfg, len));
    slot = std::max(slot, (bytes.back() + 3) / 4 * 4);
    wsBytes = std::max(wsBytes, gpu::encodeWorkspaceBytes(cfg, DataType::Float32, len));
  }
  const std::vector<float> x = makeValues(total, Data::Normal, rng, 1.f);
  const std::vector<float> residual0 = makeValues(total, Data::Normal, rng, 0.1f);
  DeviceBuffer dx(4 * total), dws(wsBytes), together(n * slot), apart(n * slot), rTogether(4 * total),
      rApart(4 * total);
  dx.upload(x.data(), 4 * total);
  rTogether.upload(residual0.data(), 4 * total);
  rApart.upload(residual0.data(), 4 * total);
  together.fill(kPoison);
  apart.fill(kPoison);
  auto chunk = [&](size_t i, DeviceBuffer& payloads, DeviceBuffer& residual) {
    return gpu::EncodeChunk{dx.as<float>() + begin[i], residual.as<float>() + begin[i], begin[i + 1] - begin[i],
                            stream + 7 * i, payloads.as() + i * slot, slot};
  };
  std::vector<uint8_t> got(n * slot), want(n * slot);
  try {
    std::vector<gpu::EncodeChunk> chunks;
    for (size_t i = 0; i < n; ++i) chunks.push_back(chunk(i, together, rTogether));
    gpu::encodeChunksCuda(cfg, DataType::Float32, chunks.data(), n, dws.ptr, wsBytes, s);
    for (size_t i = 0; i < n; ++i) {
      const gpu::EncodeChunk c = chunk(i, apart, rApart);
      gpu::encodeCuda(cfg, DataType::Float32, c.x, c.residual, c.numel, c.stream, c.payload, c.capacity, dws.ptr,
                      wsBytes, s);
    }
    DDLCOMM_CUDA_CHECK(cudaStreamSynchronize(s));
  } catch (const std::exception& e) {
    check(false, name + ": encode", e.what());
    return;
  }
  together.download(got.data(), got.size());
  apart.download(want.data(), want.size());
  check(got == want, name + ": payloads equal the single encodes'");
  std::vector<float> r1(total), r2(total);
  rTogether.download(r1.data(), 4 * total);
  rApart.download(r2.data(), 4 * total);
  checkArrays(name + ": residuals equal the single encodes'", r1.data(), r2.data(), total, DataType::Float32);

  for (DataType out : {DataType::Float32, DataType::BFloat16}) {
    const size_t es = elementSize(out);
    DeviceBuffer dTogether(total * es), dApart(total * es);
    dTogether.fill(kPoison);
    dApart.fill(kPoison);
    std::vector<uint8_t> a(total * es), b(total * es);
    try {
      std::vector<gpu::DecodeChunk> chunks;
      for (size_t i = 0; i < n; ++i) {
        chunks.push_back({apart.as() + i * slot, bytes[i], dTogether.as() + begin[i] * es, begin[i + 1] - begin[i]});
      }
      gpu::decodeChunksCuda(cfg, chunks.data(), n, out, s);
      for (const gpu::DecodeChunk& c : chunks) {
        if (c.numel == 0) continue;
        gpu::decodeCuda(gpu::expectedInfo(cfg, c.numel, c.bytes), c.payload, c.bytes, out,
                        dApart.as() + (static_cast<uint8_t*>(c.out) - dTogether.as()), c.numel, s);
      }
      DDLCOMM_CUDA_CHECK(cudaStreamSynchronize(s));
    } catch (const std::exception& e) {
      check(false, name + ": decode", e.what());
      continue;
    }
    dTogether.download(a.data(), a.size());
    dApart.download(b.data(), b.size());
    checkArrays(name + ": decodes to " + dataTypeName(out) + " equal the single decodes'", a.data(), b.data(), total,
                out);
  }
  if (compress::isSparse(cfg.format) || n == 0) return;

  // n payloads of chunk 0's size: chunk 0's, then those of the elements after it.
  const size_t len = begin[1], size = gpu::encodedBytesCuda(cfg, len);
  const std::vector<float> y = makeValues(n * len, Data::Normal, rng, 1.f);
  DeviceBuffer dy(4 * n * len), dsummed(n * slot), dsum(4 * len), dref(4 * len);
  dy.upload(y.data(), 4 * n * len);
  std::vector<gpu::EncodeChunk> chunks;
  std::vector<const uint8_t*> payloads;
  for (size_t i = 0; i < n; ++i) {
    chunks.push_back({dy.as<float>() + i * len, nullptr, len, stream + 7 * i, dsummed.as() + i * slot, slot});
    payloads.push_back(dsummed.as() + i * slot);
  }
  for (float scale : {1.f, 1.f / float(n)}) {
    std::vector<float> a(len), b(len);
    try {
      gpu::encodeChunksCuda(cfg, DataType::Float32, chunks.data(), n, dws.ptr, wsBytes, s);
      dsum.fill(kPoison);
      gpu::sumPayloadsCuda(cfg, payloads.data(), n, len, scale, dsum.as<float>(), s);
      dref.fill(0);
      for (const uint8_t* p : payloads) {
        gpu::decodeAccumulateCuda(gpu::expectedInfo(cfg, len, size), p, size, dref.as<float>(), len, s);
      }
      DDLCOMM_CUDA_CHECK(cudaStreamSynchronize(s));
    } catch (const std::exception& e) {
      check(false, name + ": sum", e.what());
      continue;
    }
    dsum.download(a.data(), 4 * len);
    dref.download(b.data(), 4 * len);
    if (scale != 1.f) {
      for (float& v : b) v *= scale;
    }
    checkArrays(name + str(": sum times ", scale, " equals the accumulated decodes'"), a.data(), b.data(), len,
                DataType::Float32);
  }
}

}  // namespace

void testCompression(const Options& opt, std::mt19937_64& rng, cudaStream_t s) {
  const std::vector<Variant> variants = {{DataType::Float32, true, Data::Normal},
                                         {DataType::Float16, true, Data::Normal},
                                         {DataType::BFloat16, false, Data::Normal},
                                         {DataType::Float32, false, Data::Ties},
                                         {DataType::Float32, true, Data::NonFinite},
                                         {DataType::BFloat16, true, Data::Ties}};
  uint64_t stream = rng();
  for (const Case& cs : compressionCases()) {
    if (!opt.filter.empty() && cs.name.find(opt.filter) == std::string::npos) continue;
    const int before = g_failed;
    for (size_t n : opt.sizes) {
      for (size_t vi = 0; vi < variants.size(); ++vi) {
        // Large sizes and --quick (the compute-sanitizer run): fewer input variants.
        if ((n > 100000 || opt.quick) && vi != 0 && vi != 4 && !(opt.quick && vi == 2)) continue;
        if (opt.quick && (cs.slow == 2 || (cs.slow == 1 && (n != 257 || vi != 0)))) continue;
        testEncodeOnce(cs, n, variants[vi], stream++, rng, s, opt.verbose);
      }
    }
    if (cs.slow == 0) {
      const std::pair<size_t, size_t> shapes[] = {{0, 3}, {5, 17}, {1000, 3}, {4099, 17}};  // elements, chunks
      for (const auto& [total, chunks] : shapes) testChunks(cs, total, chunks, stream++, rng, s);
    }
    std::printf("%-28s %s\n", cs.name.c_str(), g_failed == before ? "ok" : "FAILED");
    std::fflush(stdout);
  }
}

}  // namespace ddlcomm::cuda_test
