// Elementwise reduction kernels: dst[i] = op(dst[i], src[i]). One entry point per call,
// dispatched on dtype; float16/bfloat16 are combined in float32 and rounded once per call.
#pragma once

#include <cstddef>

#include "common/dtype.h"

namespace ddlcomm {

// AVG combines like SUM; the caller divides once at the end (see divideBy).
void reduceInto(ReduceOp op, DataType type, void* dst, const void* src, size_t count);

// data[i] /= divisor, for floating types (the AVG epilogue).
void divideBy(DataType type, void* data, size_t count, double divisor);

}  // namespace ddlcomm
