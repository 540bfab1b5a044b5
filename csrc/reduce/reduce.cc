#include "reduce/reduce.h"

#include <algorithm>
#include <cstdint>

#include "common/error.h"
#include "common/half.h"

namespace ddlcomm {
namespace {

struct SumFn {
  template <typename T> T operator()(T a, T b) const { return a + b; }
};
struct ProductFn {
  template <typename T> T operator()(T a, T b) const { return a * b; }
};
// NaN propagates, as in torch.minimum / torch.maximum.
struct MinFn {
  template <typename T> T operator()(T a, T b) const { return (a < b || a != a) ? a : b; }
};
struct MaxFn {
  template <typename T> T operator()(T a, T b) const { return (a > b || a != a) ? a : b; }
};
struct AndFn {
  template <typename T> T operator()(T a, T b) const { return a & b; }
};
struct OrFn {
  template <typename T> T operator()(T a, T b) const { return a | b; }
};
struct XorFn {
  template <typename T> T operator()(T a, T b) const { return a ^ b; }
};

template <typename T, typename Fn>
[[gnu::always_inline]] inline void combine(T* __restrict dst, const T* __restrict src, size_t n, Fn fn) {
  for (size_t i = 0; i < n; ++i) dst[i] = fn(dst[i], src[i]);
}

// 16-bit floats: widen, combine in float, narrow.
template <float (*Load)(uint16_t), uint16_t (*Store)(float), typename Fn>
[[gnu::always_inline]] inline void combineHalf(uint16_t* __restrict dst, const uint16_t* __restrict src,
                                               size_t n, Fn fn) {
  for (size_t i = 0; i < n; ++i) dst[i] = Store(fn(Load(dst[i]), Load(src[i])));
}

#define DDLCOMM_ARITH_CASES(CALL)            \
  case ReduceOp::Sum:                        \
  case ReduceOp::Avg: CALL(SumFn{}); return; \
  case ReduceOp::Product: CALL(ProductFn{}); return; \
  case ReduceOp::Min: CALL(MinFn{}); return; \
  case ReduceOp::Max: CALL(MaxFn{}); return;

template <typename T>
[[gnu::always_inline]] inline void reduceFloat(ReduceOp op, T* d, const T* s, size_t n) {
#define CALL(fn) combine(d, s, n, fn)
  switch (op) {
    DDLCOMM_ARITH_CASES(CALL)
    default: break;
  }
#undef CALL
  fail(ErrorKind::UnsupportedType, "reduce op ", reduceOpName(op), " is not defined for floating types");
}

template <typename T>
[[gnu::always_inline]] inline void reduceInt(ReduceOp op, T* d, const T* s, size_t n) {
#define CALL(fn) combine(d, s, n, fn)
  switch (op) {
    DDLCOMM_ARITH_CASES(CALL)
    case ReduceOp::BitAnd: CALL(AndFn{}); return;
    case ReduceOp::BitOr: CALL(OrFn{}); return;
    case ReduceOp::BitXor: CALL(XorFn{}); return;
  }
#undef CALL
}

template <float (*Load)(uint16_t), uint16_t (*Store)(float)>
[[gnu::always_inline]] inline void reduceHalf(ReduceOp op, uint16_t* d, const uint16_t* s, size_t n) {
#define CALL(fn) combineHalf<Load, Store>(d, s, n, fn)
  switch (op) {
    DDLCOMM_ARITH_CASES(CALL)
    default: break;
  }
#undef CALL
  fail(ErrorKind::UnsupportedType, "reduce op ", reduceOpName(op), " is not defined for floating types");
}

// Bool is stored as one byte holding 0 or 1: SUM/MAX/BOR are "or", PRODUCT/MIN/BAND "and".
[[gnu::always_inline]] inline void reduceBool(ReduceOp op, uint8_t* d, const uint8_t* s, size_t n) {
  switch (op) {
    case ReduceOp::Sum:
    case ReduceOp::Max:
    case ReduceOp::BitOr: combine(d, s, n, OrFn{}); return;
    case ReduceOp::Product:
    case ReduceOp::Min:
    case ReduceOp::BitAnd: combine(d, s, n, AndFn{}); return;
    case ReduceOp::BitXor: combine(d, s, n, XorFn{}); return;
    case ReduceOp::Avg: break;
  }
  fail(ErrorKind::UnsupportedType, "ReduceOp.AVG is not defined for bool");
}
#undef DDLCOMM_ARITH_CASES

// One multiversioned entry point per dtype family keeps the hot loops inlined into each clone.
DDLCOMM_MULTIVERSION void reduceF32(ReduceOp op, float* d, const float* s, size_t n) { reduceFloat(op, d, s, n); }
DDLCOMM_MULTIVERSION void reduceF64(ReduceOp op, double* d, const double* s, size_t n) { reduceFloat(op, d, s, n); }
DDLCOMM_MULTIVERSION void reduceF16(ReduceOp op, uint16_t* d, const uint16_t* s, size_t n) {
  reduceHalf<fp16ToFloat, floatToFp16>(op, d, s, n);
}
DDLCOMM_MULTIVERSION void reduceBF16(ReduceOp op, uint16_t* d, const uint16_t* s, size_t n) {
  reduceHalf<bf16ToFloat, floatToBf16>(op, d, s, n);
}
DDLCOMM_MULTIVERSION void reduceI8(ReduceOp op, int8_t* d, const int8_t* s, size_t n) { reduceInt(op, d, s, n); }
DDLCOMM_MULTIVERSION void reduceU8(ReduceOp op, uint8_t* d, const uint8_t* s, size_t n) { reduceInt(op, d, s, n); }
DDLCOMM_MULTIVERSION void reduceI32(ReduceOp op, int32_t* d, const int32_t* s, size_t n) { reduceInt(op, d, s, n); }
DDLCOMM_MULTIVERSION void reduceI64(ReduceOp op, int64_t* d, const int64_t* s, size_t n) { reduceInt(op, d, s, n); }
DDLCOMM_MULTIVERSION void reduceB8(ReduceOp op, uint8_t* d, const uint8_t* s, size_t n) { reduceBool(op, d, s, n); }

template <typename T>
void divide(T* data, size_t n, T divisor) {
  for (size_t i = 0; i < n; ++i) data[i] /= divisor;
}

}  // namespace

void reduceInto(ReduceOp op, DataType type, void* dst, const void* src, size_t count) {
  switch (type) {
    case DataType::Float32: return reduceF32(op, static_cast<float*>(dst), static_cast<const float*>(src), count);
    case DataType::Float64: return reduceF64(op, static_cast<double*>(dst), static_cast<const double*>(src), count);
    case DataType::Float16:
      return reduceF16(op, static_cast<uint16_t*>(dst), static_cast<const uint16_t*>(src), count);
    case DataType::BFloat16:
      return reduceBF16(op, static_cast<uint16_t*>(dst), static_cast<const uint16_t*>(src), count);
    case DataType::Int8: return reduceI8(op, static_cast<int8_t*>(dst), static_cast<const int8_t*>(src), count);
    case DataType::UInt8: return reduceU8(op, static_cast<uint8_t*>(dst), static_cast<const uint8_t*>(src), count);
    case DataType::Int32: return reduceI32(op, static_cast<int32_t*>(dst), static_cast<const int32_t*>(src), count);
    case DataType::Int64: return reduceI64(op, static_cast<int64_t*>(dst), static_cast<const int64_t*>(src), count);
    case DataType::Bool: return reduceB8(op, static_cast<uint8_t*>(dst), static_cast<const uint8_t*>(src), count);
  }
  fail(ErrorKind::UnsupportedType, "reduce: unknown data type ", int(type));
}

void divideBy(DataType type, void* data, size_t count, double divisor) {
  switch (type) {
    case DataType::Float32: return divide(static_cast<float*>(data), count, float(divisor));
    case DataType::Float64: return divide(static_cast<double*>(data), count, divisor);
    case DataType::Float16: {
      auto* p = static_cast<uint16_t*>(data);
      for (size_t i = 0; i < count; ++i) p[i] = floatToFp16(fp16ToFloat(p[i]) / float(divisor));
      return;
    }
    case DataType::BFloat16: {
      auto* p = static_cast<uint16_t*>(data);
      for (size_t i = 0; i < count; ++i) p[i] = floatToBf16(bf16ToFloat(p[i]) / float(divisor));
      return;
    }
    default: fail(ErrorKind::UnsupportedType, "division is only defined for floating types, got ", dataTypeName(type));
  }
}

}  // namespace ddlcomm
