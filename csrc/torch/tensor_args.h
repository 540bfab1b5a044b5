// Argument handling shared by the backend's operations (csrc/torch/backend*.cc): dtype and
// reduce-op translation, tensor checks that raise the torch exception a user expects, and
// the contiguous copies of non-contiguous tensors.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <optional>
#include <string>
#include <vector>

#include "common/dtype.h"

namespace ddlcomm::torch_glue {

// The ddlcomm dtype of t; TypeError for dtypes ddlcomm does not handle.
DataType toDataType(const at::Tensor& t);
// torch's name of a dtype ("torch.int16"), which users know, rather than c10's ("Short").
std::string dtypeName(at::ScalarType type);
// The reduction for `op` on `dtype`; TypeError for pairs that make no sense (AVG of ints).
ReduceOp toReduceOp(const c10d::ReduceOp& op, DataType dtype);
// PREMUL_SUM's factor applied to a copy of `t`; `t` itself for every other op.
at::Tensor premultiplied(const c10d::ReduceOp& op, const at::Tensor& t);
// ValueError / TypeError unless `t` is a defined, dense CPU tensor of a supported dtype.
void checkTensor(const at::Tensor& t, const char* role);
// The one tensor of a single-tensor operation, checked.
at::Tensor single(std::vector<at::Tensor>& tensors, const char* op);
void checkSameType(const at::Tensor& a, const at::Tensor& b, const char* op);
// The compressed collectives' arguments, on any device (both the backend's and the
// collectives path's): TypeError unless `t` is float32, float16 or bfloat16, ValueError unless
// it is dense; a residual (when given) must be a contiguous float32 tensor of `numel` elements on
// `device`; a reduce-scatter's input holds `size` outputs of the output's dtype.
void checkCompressible(const at::Tensor& t, const char* op);
void checkResidual(const std::optional<at::Tensor>& r, int64_t numel, const char* which, c10::Device device);
void checkReduceScatterShapes(const at::Tensor& output, const at::Tensor& input, int size);
// A contiguous tensor with t's values (t itself when contiguous); writeBack copies the result
// into the user's tensor when they differ.
at::Tensor staged(const at::Tensor& t);
void writeBack(at::Tensor& user, const at::Tensor& work);
void checkRoot(int64_t root, int size);

}  // namespace ddlcomm::torch_glue
