// GPU test of csrc/cuda against host references: the scalar contract model (reference.cc),
// ddlcomm::reduceInto / divideBy (csrc/reduce), and, when csrc/compress/*.cc exists, the CPU
// compressors themselves (DDLCOMM_TEST_CPU_COMPRESS). Host code only: it calls the launchers
// of cuda_kernels.h and the CUDA runtime, so it also runs on the CPU emulator (tests/cuda/emu).
//
//   test_cuda_kernels [--quick] [--large] [--sizes=0,1,255] [--seed=N] [--filter=text] [--verbose]
//
// Prints "N passed, M failed" last; exit 0 when all pass, 1 on a failure, 77 without a GPU.
// Made for compute-sanitizer too: every buffer is an exact-size cudaMalloc, outputs are
// poisoned before each call and checked completely afterwards.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "common/error.h"
#include "common/half.h"
#include "compress/compress.h"
#include "cuda/cuda_check.h"
#include "cuda/cuda_kernels.h"
#include "reduce/reduce.h"
#include "reference.h"

using namespace ddlcomm;
using compress::Config;
using compress::Format;

namespace {

// ---- bookkeeping ----------------------------------------------------------------------------
struct Options {
  bool quick = false, large = false, verbose = false;
  std::vector<size_t> sizes;
  uint64_t seed = 0;
  std::string filter;
};

int g_passed = 0, g_failed = 0;

void check(bool ok, const std::string& name, const std::string& detail = "") {
  if (ok) {
    ++g_passed;
    return;
  }
  ++g_failed;
  if (g_failed <= 60) std::printf("FAIL %s%s%s\n", name.c_str(), detail.empty() ? "" : ": ", detail.c_str());
  if (g_failed == 60) std::printf("(further failures are counted, not printed)\n");
}

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

// ---- comparisons (bitwise, except that any two NaNs are equal: NaN payload bits are not part
// of the contract, x86 propagates input payloads where GPUs produce a canonical NaN) -----------
bool sameF32(uint32_t a, uint32_t b) { return a == b || ((a & 0x7fffffffu) > 0x7f800000u && (b & 0x7fffffffu) > 0x7f800000u); }
bool sameHalf(uint16_t a, uint16_t b, DataType t) {
  const uint16_t inf = t == DataType::Float16 ? 0x7c00 : 0x7f80;
  return a == b || ((a & 0x7fff) > inf && (b & 0x7fff) > inf);
}

// First differing element of two arrays of `type`, or -1.
long long firstDifference(const void* a, const void* b, size_t n, DataType type) {
  const size_t es = elementSize(type);
  for (size_t i = 0; i < n; ++i) {
    const auto* pa = static_cast<const uint8_t*>(a) + i * es;
    const auto* pb = static_cast<const uint8_t*>(b) + i * es;
    bool same;
    if (type == DataType::Float32) {
      uint32_t x, y;
      std::memcpy(&x, pa, 4);
      std::memcpy(&y, pb, 4);
      same = sameF32(x, y);
    } else if (type == DataType::Float16 || type == DataType::BFloat16) {
      uint16_t x, y;
      std::memcpy(&x, pa, 2);
      std::memcpy(&y, pb, 2);
      same = sameHalf(x, y, type);
    } else if (type == DataType::Float64) {
      double x, y;
      std::memcpy(&x, pa, 8);
      std::memcpy(&y, pb, 8);
      same = std::memcmp(pa, pb, 8) == 0 || (std::isnan(x) && std::isnan(y));
    } else {
      same = std::memcmp(pa, pb, es) == 0;
    }
    if (!same) return (long long)i;
  }
  return -1;
}

std::string describeElement(const void* got, const void* want, long long i, DataType type) {
  const size_t es = elementSize(type);
  uint64_t g = 0, w = 0;
  std::memcpy(&g, static_cast<const uint8_t*>(got) + i * es, es);
  std::memcpy(&w, static_cast<const uint8_t*>(want) + i * es, es);
  std::ostringstream out;
  out << "element " << i << ": got 0x" << std::hex << g << ", want 0x" << w << std::dec;
  if (type == DataType::Float32) {
    float gf, wf;
    std::memcpy(&gf, &g, 4);
    std::memcpy(&wf, &w, 4);
    out << " (" << gf << " vs " << wf << ")";
  }
  return out.str();
}

void checkArrays(const std::string& name, const void* got, const void* want, size_t n, DataType type) {
  const long long d = firstDifference(got, want, n, type);
  check(d < 0, name, d < 0 ? "" : describeElement(got, want, d, type));
}

// Payload bytes, section by section (float sections NaN-tolerant, everything else exact).
std::string comparePayloads(const std::vector<uint8_t>& got, const std::vector<uint8_t>& want) {
  if (got.size() != want.size()) return str("size ", got.size(), " vs ", want.size());
  if (got.size() < 32) return "short payload";
  if (std::memcmp(got.data(), want.data(), 32) != 0) {
    for (int i = 0; i < 32; ++i)
      if (got[i] != want[i]) return str("header byte ", i, ": ", int(got[i]), " vs ", int(want[i]));
  }
  const auto f = Format(want[5]);
  uint64_t numel, k;
  uint32_t blockSize;
  std::memcpy(&blockSize, &want[8], 4);
  std::memcpy(&numel, &want[16], 8);
  std::memcpy(&k, &want[24], 8);
  size_t floatsAt = 0, floatsCount = 0, halfsAt = 0, halfsCount = 0;
  DataType halfType = DataType::Float16;
  switch (f) {
    case Format::OneBit:
    case Format::Ternary: {
      const uint64_t nb = blockSize ? (numel + blockSize - 1) / blockSize : 0;
      floatsAt = 32;
      floatsCount = nb * ((f == Format::OneBit && (want[6] & compress::kFlagTwoScales)) ? 2 : 1);
      break;
    }
    case Format::TopK:
    case Format::RandomK:
      floatsAt = 32 + 4 * k;
      floatsCount = k;
      break;
    case Format::Float16:
    case Format::BFloat16:
      halfsAt = 32;
      halfsCount = numel;
      halfType = f == Format::Float16 ? DataType::Float16 : DataType::BFloat16;
      break;
  }
  for (size_t i = 32; i < got.size(); ++i) {
    if (i >= floatsAt && i < floatsAt + 4 * floatsCount) {
      const size_t e = (i - floatsAt) / 4;
      const long long d = firstDifference(&got[floatsAt + 4 * e], &want[floatsAt + 4 * e], 1, DataType::Float32);
      if (d >= 0) return str("float at byte ", floatsAt + 4 * e, ": ", describeElement(&got[floatsAt], &want[floatsAt], e, DataType::Float32));
      i = floatsAt + 4 * e + 3;
    } else if (i >= halfsAt && i < halfsAt + 2 * halfsCount) {
      const size_t e = (i - halfsAt) / 2;
      if (firstDifference(&got[halfsAt + 2 * e], &want[halfsAt + 2 * e], 1, halfType) >= 0)
        return str("16-bit value ", e, ": ", describeElement(&got[halfsAt], &want[halfsAt], e, halfType));
      i = halfsAt + 2 * e + 1;
    } else if (got[i] != want[i]) {
      return str("byte ", i, ": 0x", std::hex, int(got[i]), " vs 0x", int(want[i]));
    }
  }
  return "";
}

// ---- data -------------------------------------------------------------------------------------
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
        testEncodeOnce(cs, n, variants[vi], stream++, rng, s, opt.verbose);
      }
    }
    std::printf("%-28s %s\n", cs.name.c_str(), g_failed == before ? "ok" : "FAILED");
    std::fflush(stdout);
  }
}

// ---- reductions -----------------------------------------------------------------------------
std::vector<uint8_t> randomData(DataType t, size_t n, std::mt19937_64& rng, bool withNan) {
  std::vector<uint8_t> out(n * elementSize(t));
  if (t == DataType::Bool) {
    for (auto& b : out) b = rng() & 1;
  } else if (isFloatingPoint(t)) {
    std::normal_distribution<double> normal(0.0, 10.0);
    for (size_t i = 0; i < n; ++i) {
      double v = normal(rng);
      if (withNan && rng() % 50 == 0) v = (rng() & 1) ? NAN : INFINITY;
      if (rng() % 40 == 0) v = 0.0;
      if (t == DataType::Float64) {
        std::memcpy(&out[8 * i], &v, 8);
      } else {
        ref::storeFromFloat(t, out.data(), i, float(v));
      }
    }
  } else {
    for (auto& b : out) b = uint8_t(rng());
  }
  return out;
}

void testReduce(const Options& opt, std::mt19937_64& rng, cudaStream_t s) {
  const DataType types[] = {DataType::Float32, DataType::Float64, DataType::Float16, DataType::BFloat16, DataType::Int8,
                            DataType::UInt8,   DataType::Int32,   DataType::Int64,   DataType::Bool};
  const ReduceOp ops[] = {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Min, ReduceOp::Max,
                          ReduceOp::Product, ReduceOp::BitAnd, ReduceOp::BitOr, ReduceOp::BitXor};
  for (DataType t : types) {
    const int before = g_failed;
    for (ReduceOp op : ops) {
      const std::string base = str("reduce ", reduceOpName(op), " ", dataTypeName(t));
      if (!opt.filter.empty() && base.find(opt.filter) == std::string::npos) continue;
      bool supported = true;
      try {
        checkReduceOpSupported(op, t);
      } catch (const Error&) {
        supported = false;
      }
      if (!supported) {
        bool threw = false;
        DeviceBuffer d(16), e(16);
        try {
          gpu::reduceCuda(op, t, d.ptr, e.ptr, 1, s);
        } catch (const Error& err) {
          threw = err.kind() == ErrorKind::UnsupportedType;
        }
        check(threw, base + ": rejected like the CPU");
        continue;
      }
      const size_t es = elementSize(t);
      for (size_t n : opt.sizes) {
        for (size_t offset : {size_t(0), size_t(1)}) {  // offset 1: unaligned, scalar path
          const std::string name = str(base, " n=", n, " offset=", offset);
          const auto dst0 = randomData(t, n + offset, rng, true);
          const auto src = randomData(t, n + offset, rng, true);
          DeviceBuffer dd(dst0.size()), ds(src.size());
          dd.upload(dst0.data(), dst0.size());
          ds.upload(src.data(), src.size());
          std::vector<uint8_t> got(dst0.size()), want = dst0;
          try {
            gpu::reduceCuda(op, t, dd.as() + offset * es, ds.as() + offset * es, n, s);
            DDLCOMM_CUDA_CHECK(cudaStreamSynchronize(s));
          } catch (const std::exception& e) {
            check(false, name, e.what());
            continue;
          }
          dd.download(got.data(), got.size());
          reduceInto(op, t, want.data() + offset * es, src.data() + offset * es, n);
          checkArrays(name, got.data(), want.data(), n + offset, t);
        }
      }
    }
    if (isFloatingPoint(t) && (opt.filter.empty() || std::string("divide").find(opt.filter) != std::string::npos ||
                               std::string(dataTypeName(t)).find(opt.filter) != std::string::npos)) {
      for (double divisor : {3.0, 0.5, 7.0}) {
        for (size_t n : opt.sizes) {
          const std::string name = str("divide ", dataTypeName(t), " by ", divisor, " n=", n);
          const auto data0 = randomData(t, n, rng, true);
          DeviceBuffer dd(data0.size());
          dd.upload(data0.data(), data0.size());
          std::vector<uint8_t> got(data0.size()), want = data0;
          gpu::divideCuda(t, dd.ptr, n, divisor, s);
          DDLCOMM_CUDA_CHECK(cudaStreamSynchronize(s));
          dd.download(got.data(), got.size());
          divideBy(t, want.data(), n, divisor);
          checkArrays(name, got.data(), want.data(), n, t);
        }
      }
    }
    std::printf("reduce/divide %-14s %s\n", dataTypeName(t), g_failed == before ? "ok" : "FAILED");
    std::fflush(stdout);
  }
}

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
  c = Config{};
  compress::PayloadInfo info{Format::OneBit, 0, 256, n, 0};
  const size_t bytes = gpu::encodedBytesCuda(c, n);
  expectError("decode: numel mismatch", ErrorKind::InvalidArgument,
              [&] { gpu::decodeCuda(info, pay.as(), bytes, DataType::Float32, x.ptr, n - 1, s); });
  expectError("decode: size mismatch", ErrorKind::Protocol,
              [&] { gpu::decodeCuda(info, pay.as(), bytes + 1, DataType::Float32, x.ptr, n, s); });
  expectError("decode: int output", ErrorKind::UnsupportedType,
              [&] { gpu::decodeCuda(info, pay.as(), bytes, DataType::Int32, x.ptr, n, s); });
  expectError("reduce: AVG on int32", ErrorKind::UnsupportedType,
              [&] { gpu::reduceCuda(ReduceOp::Avg, DataType::Int32, x.ptr, x.ptr, 1, s); });
  expectError("divide: int8", ErrorKind::UnsupportedType, [&] { gpu::divideCuda(DataType::Int8, x.ptr, 1, 2.0, s); });
}

// ---- more than 2^31 elements: 64-bit indexing ---------------------------------------------------
void testLarge(std::mt19937_64& rng, cudaStream_t s) {
  const size_t n = (size_t(1) << 31) + 77;
  std::printf("large: n = %zu\n", n);
  {  // int8 sum over 2^31 + 77 bytes, compared completely.
    std::vector<uint8_t> a(n), b(n);
    for (size_t i = 0; i < n; ++i) {
      a[i] = uint8_t(i * 2654435761u >> 13);
      b[i] = uint8_t(i * 40503u + 7);
    }
    DeviceBuffer da(n), db(n);
    da.upload(a.data(), n);
    db.upload(b.data(), n);
    gpu::reduceCuda(ReduceOp::Sum, DataType::Int8, da.ptr, db.ptr, n, s);
    DDLCOMM_CUDA_CHECK(cudaStreamSynchronize(s));
    std::vector<uint8_t> got(n);
    da.download(got.data(), n);
    reduceInto(ReduceOp::Sum, DataType::Int8, a.data(), b.data(), n);
    checkArrays("large: reduce SUM int8", got.data(), a.data(), n, DataType::Int8);
  }
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
    testReduce(opt, rng, s);
    if (opt.large) testLarge(rng, s);
  } catch (const std::exception& e) {
    check(false, "unexpected exception", e.what());
  }
  cudaStreamDestroy(s);
  std::printf("%d passed, %d failed\n", g_passed, g_failed);
  return g_failed ? 1 : 0;
}
