// Element types and reduction operators shared by kernels, wire formats and collectives.
// Values are part of the wire format: append, never renumber.
#pragma once

#include <cstddef>
#include <cstdint>

namespace ddlcomm {

enum class DataType : uint8_t {
  Float32 = 0,
  Float64 = 1,
  Float16 = 2,
  BFloat16 = 3,
  Int8 = 4,
  UInt8 = 5,
  Int32 = 6,
  Int64 = 7,
  Bool = 8,
};
constexpr int kNumDataTypes = 9;

enum class ReduceOp : uint8_t {
  Sum = 0,
  Avg = 1,  // sum, then divide by the number of ranks (floating types only)
  Min = 2,
  Max = 3,
  Product = 4,
  BitAnd = 5,
  BitOr = 6,
  BitXor = 7,
};

size_t elementSize(DataType type);
// torch's name of the type ("torch.float32"), the one users write, for every message.
const char* dataTypeName(DataType type);
const char* reduceOpName(ReduceOp op);
bool isFloatingPoint(DataType type);
bool isValidDataType(uint8_t raw);

// Throws InvalidArgument/UnsupportedType with a message naming both when `op` makes no
// sense for `type` (AVG on integers, bitwise ops on floats).
void checkReduceOpSupported(ReduceOp op, DataType type);

}  // namespace ddlcomm
