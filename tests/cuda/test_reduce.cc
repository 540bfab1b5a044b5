// Reductions and AVG's division on the GPU against ddlcomm::reduceInto / divideBy (csrc/reduce):
// every dtype and op, aligned and unaligned, with NaN and infinity among the inputs; unsupported
// pairs must be rejected as on the CPU.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <exception>

#include "common/error.h"
#include "cuda/reduce_kernels.h"
#include "harness.h"
#include "reduce/reduce.h"
#include "reference.h"

namespace ddlcomm::cuda_test {
namespace {

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

}  // namespace

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

}  // namespace ddlcomm::cuda_test
