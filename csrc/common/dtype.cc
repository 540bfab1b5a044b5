#include "common/dtype.h"

#include "common/error.h"

namespace ddlcomm {

size_t elementSize(DataType type) {
  switch (type) {
    case DataType::Float32: return 4;
    case DataType::Float64: return 8;
    case DataType::Float16: return 2;
    case DataType::BFloat16: return 2;
    case DataType::Int8: return 1;
    case DataType::UInt8: return 1;
    case DataType::Int32: return 4;
    case DataType::Int64: return 8;
    case DataType::Bool: return 1;
  }
  fail(ErrorKind::UnsupportedType, "unknown data type ", int(type));
}

const char* dataTypeName(DataType type) {
  switch (type) {
    case DataType::Float32: return "torch.float32";
    case DataType::Float64: return "torch.float64";
    case DataType::Float16: return "torch.float16";
    case DataType::BFloat16: return "torch.bfloat16";
    case DataType::Int8: return "torch.int8";
    case DataType::UInt8: return "torch.uint8";
    case DataType::Int32: return "torch.int32";
    case DataType::Int64: return "torch.int64";
    case DataType::Bool: return "torch.bool";
  }
  return "unknown";
}

const char* reduceOpName(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum: return "SUM";
    case ReduceOp::Avg: return "AVG";
    case ReduceOp::Min: return "MIN";
    case ReduceOp::Max: return "MAX";
    case ReduceOp::Product: return "PRODUCT";
    case ReduceOp::BitAnd: return "BAND";
    case ReduceOp::BitOr: return "BOR";
    case ReduceOp::BitXor: return "BXOR";
  }
  return "unknown";
}

bool isFloatingPoint(DataType type) {
  return type == DataType::Float32 || type == DataType::Float64 ||
         type == DataType::Float16 || type == DataType::BFloat16;
}

bool isValidDataType(uint8_t raw) { return raw < kNumDataTypes; }

void checkReduceOpSupported(ReduceOp op, DataType type) {
  const bool bitwise =
      op == ReduceOp::BitAnd || op == ReduceOp::BitOr || op == ReduceOp::BitXor;
  if (bitwise && isFloatingPoint(type)) {
    fail(ErrorKind::UnsupportedType, "ReduceOp.", reduceOpName(op), " needs an integer or bool tensor, got ",
         dataTypeName(type));
  }
  if (op == ReduceOp::Avg && !isFloatingPoint(type)) {
    fail(ErrorKind::UnsupportedType, "ReduceOp.AVG needs a floating-point tensor, got ", dataTypeName(type),
         " (use SUM and divide)");
  }
}

}  // namespace ddlcomm
