// Elementwise reductions dst[i] = op(dst[i], src[i]) and the AVG epilogue, with the semantics
// of csrc/reduce/reduce.cc: NaN propagates through MIN/MAX, integers wrap, float16/bfloat16
// are combined in float32 and rounded to nearest even, bool is 0/1 bytes with
// SUM/MAX/BOR = or, PRODUCT/MIN/BAND = and. Memory-bound: 16-byte accesses when both
// pointers allow it.
#include <type_traits>

#include "cuda/common.cuh"
#include "cuda/reduce_kernels.h"

namespace ddlcomm::gpu {
namespace {

constexpr int kThreads = 256;

enum class Fn { Sum, Prod, Min, Max, And, Or, Xor };

template <Fn kFn, typename T>
__device__ __forceinline__ T apply(T a, T b) {
  if constexpr (kFn == Fn::Min) {
    return (a < b || a != a) ? a : b;
  } else if constexpr (kFn == Fn::Max) {
    return (a > b || a != a) ? a : b;
  } else if constexpr (std::is_same_v<T, float>) {
    return kFn == Fn::Sum ? __fadd_rn(a, b) : __fmul_rn(a, b);
  } else if constexpr (std::is_same_v<T, double>) {
    return kFn == Fn::Sum ? __dadd_rn(a, b) : __dmul_rn(a, b);
  } else {
    // Integers: wrap around (two's complement) like the CPU build, without signed overflow.
    using U = std::make_unsigned_t<T>;
    switch (kFn) {
      case Fn::Sum: return T(U(U(a) + U(b)));
      case Fn::Prod: return T(U(U(a) * U(b)));
      case Fn::And: return T(a & b);
      case Fn::Or: return T(a | b);
      default: return T(a ^ b);
    }
  }
}

// Storage type S with an arithmetic view: identity for most types, float32 for the halves.
template <typename S, typename Conv>
struct View {
  template <Fn kFn>
  static __device__ __forceinline__ S combine(S a, S b) {
    return Conv::fromFloat(apply<kFn, float>(Conv::toFloat(a), Conv::toFloat(b)));
  }
};
template <typename S>
struct View<S, void> {
  template <Fn kFn>
  static __device__ __forceinline__ S combine(S a, S b) { return apply<kFn, S>(a, b); }
};

template <Fn kFn, typename S, typename Conv>
__global__ __launch_bounds__(kThreads) void reduceScalarKernel(S* __restrict__ dst, const S* __restrict__ src,
                                                               uint64_t n) {
  const uint64_t stride = uint64_t(gridDim.x) * blockDim.x;
  for (uint64_t i = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
    dst[i] = View<S, Conv>::template combine<kFn>(dst[i], src[i]);
}

template <typename S>
struct alignas(16) Vec16 {
  S v[16 / sizeof(S)];
};

template <Fn kFn, typename S, typename Conv>
__global__ __launch_bounds__(kThreads) void reduceVecKernel(Vec16<S>* __restrict__ dst, const Vec16<S>* __restrict__ src,
                                                            uint64_t nvec) {
  const uint64_t stride = uint64_t(gridDim.x) * blockDim.x;
  for (uint64_t i = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < nvec; i += stride) {
    Vec16<S> a = dst[i];
    const Vec16<S> b = src[i];
#pragma unroll
    for (int j = 0; j < int(16 / sizeof(S)); ++j) a.v[j] = View<S, Conv>::template combine<kFn>(a.v[j], b.v[j]);
    dst[i] = a;
  }
}

template <Fn kFn, typename S, typename Conv = void>
void run(void* dstRaw, const void* srcRaw, uint64_t n, cudaStream_t stream) {
  auto* dst = static_cast<S*>(dstRaw);
  const auto* src = static_cast<const S*>(srcRaw);
  constexpr uint64_t kPerVec = 16 / sizeof(S);
  uint64_t done = 0;
  if ((reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src)) % 16 == 0) {
    const uint64_t nvec = n / kPerVec;
    launch(reduceVecKernel<kFn, S, Conv>, gridFor(nvec, kThreads * 4), kThreads, stream,
           reinterpret_cast<Vec16<S>*>(dst), reinterpret_cast<const Vec16<S>*>(src), nvec);
    done = nvec * kPerVec;
  }
  launch(reduceScalarKernel<kFn, S, Conv>, gridFor(n - done, kThreads * 4), kThreads, stream, dst + done, src + done,
         n - done);
}

template <typename S, typename Conv = void>
void runArith(ReduceOp op, void* dst, const void* src, uint64_t n, cudaStream_t s) {
  switch (op) {
    case ReduceOp::Sum:
    case ReduceOp::Avg: return run<Fn::Sum, S, Conv>(dst, src, n, s);
    case ReduceOp::Product: return run<Fn::Prod, S, Conv>(dst, src, n, s);
    case ReduceOp::Min: return run<Fn::Min, S, Conv>(dst, src, n, s);
    case ReduceOp::Max: return run<Fn::Max, S, Conv>(dst, src, n, s);
    default: break;
  }
  fail(ErrorKind::UnsupportedType, "reduce op ", reduceOpName(op), " is not defined for floating types");
}

template <typename S>
void runInt(ReduceOp op, void* dst, const void* src, uint64_t n, cudaStream_t s) {
  switch (op) {
    case ReduceOp::BitAnd: return run<Fn::And, S>(dst, src, n, s);
    case ReduceOp::BitOr: return run<Fn::Or, S>(dst, src, n, s);
    case ReduceOp::BitXor: return run<Fn::Xor, S>(dst, src, n, s);
    default: return runArith<S>(op, dst, src, n, s);
  }
}

void runBool(ReduceOp op, void* dst, const void* src, uint64_t n, cudaStream_t s) {
  switch (op) {
    case ReduceOp::Sum:
    case ReduceOp::Max:
    case ReduceOp::BitOr: return run<Fn::Or, uint8_t>(dst, src, n, s);
    case ReduceOp::Product:
    case ReduceOp::Min:
    case ReduceOp::BitAnd: return run<Fn::And, uint8_t>(dst, src, n, s);
    case ReduceOp::BitXor: return run<Fn::Xor, uint8_t>(dst, src, n, s);
    case ReduceOp::Avg: break;
  }
  fail(ErrorKind::UnsupportedType, "ReduceOp.AVG is not defined for bool");
}

template <typename S, typename Conv, typename D>
__global__ __launch_bounds__(kThreads) void divideKernel(S* __restrict__ data, uint64_t n, D divisor) {
  const uint64_t stride = uint64_t(gridDim.x) * blockDim.x;
  for (uint64_t i = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    if constexpr (std::is_same_v<S, double>) {
      data[i] = __ddiv_rn(data[i], divisor);
    } else if constexpr (std::is_same_v<S, float>) {
      data[i] = __fdiv_rn(data[i], divisor);
    } else {
      data[i] = Conv::fromFloat(__fdiv_rn(Conv::toFloat(data[i]), divisor));
    }
  }
}

}  // namespace

void reduceCuda(ReduceOp op, DataType type, void* dst, const void* src, size_t count, cudaStream_t stream) {
  checkReduceOpSupported(op, type);
  if (count == 0) return;
  DDLCOMM_CHECK(dst && src, ErrorKind::InvalidArgument, "reduceCuda: null buffer for ", count, " elements");
  switch (type) {
    case DataType::Float32:
    case DataType::Float16:
    case DataType::BFloat16:
      // float32 through F32's identity conversions: the same bits as arithmetic on float.
      return withFloatType(type, [&](auto t) {
        using T = decltype(t);
        runArith<typename T::Raw, T>(op, dst, src, count, stream);
      });
    case DataType::Float64: return runArith<double>(op, dst, src, count, stream);
    case DataType::Int8: return runInt<int8_t>(op, dst, src, count, stream);
    case DataType::UInt8: return runInt<uint8_t>(op, dst, src, count, stream);
    case DataType::Int32: return runInt<int32_t>(op, dst, src, count, stream);
    case DataType::Int64: return runInt<int64_t>(op, dst, src, count, stream);
    case DataType::Bool: return runBool(op, dst, src, count, stream);
  }
  fail(ErrorKind::UnsupportedType, "reduceCuda: unknown data type ", int(type));
}

void divideCuda(DataType type, void* data, size_t count, double divisor, cudaStream_t stream) {
  DDLCOMM_CHECK(isFloatingPoint(type), ErrorKind::UnsupportedType,
                "division is only defined for floating types, got ", dataTypeName(type));
  if (count == 0) return;
  DDLCOMM_CHECK(data, ErrorKind::InvalidArgument, "divideCuda: null buffer for ", count, " elements");
  const uint64_t grid = gridFor(count, kThreads * 4);
  if (type == DataType::Float64) {
    return launch(divideKernel<double, void, double>, grid, kThreads, stream, static_cast<double*>(data), count,
                  divisor);
  }
  withFloatType(type, [&](auto t) {
    using T = decltype(t);
    launch(divideKernel<typename T::Raw, T, float>, grid, kThreads, stream, static_cast<typename T::Raw*>(data), count,
           float(divisor));
  });
}

}  // namespace ddlcomm::gpu
