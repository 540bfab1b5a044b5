#include "torch/tensor_args.h"

#include <ATen/Functions.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include "common/error.h"
#include "torch/backend.h"

namespace ddlcomm::torch_glue {

// torch's name of a dtype ("torch.int16"), which users know, rather than c10's ("Short").
std::string dtypeName(at::ScalarType type) { return c10::str("torch.", c10::getDtypeNames(type).first); }

DataType toDataType(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return DataType::Float32;
    case at::kDouble: return DataType::Float64;
    case at::kHalf: return DataType::Float16;
    case at::kBFloat16: return DataType::BFloat16;
    case at::kChar: return DataType::Int8;
    case at::kByte: return DataType::UInt8;
    case at::kInt: return DataType::Int32;
    case at::kLong: return DataType::Int64;
    case at::kBool: return DataType::Bool;
    default: break;
  }
  std::string supported;
  for (int i = 0; i < kNumDataTypes; ++i) supported += (i ? ", " : "") + std::string(dataTypeName(DataType(i)));
  TORCH_CHECK_TYPE(false, "ddlcomm does not support tensors of dtype ", dtypeName(t.scalar_type()),
                   "; supported: ", supported);
}

ReduceOp toReduceOp(const c10d::ReduceOp& op, DataType dtype) {
  ReduceOp result;
  switch (op.op_) {
    case c10d::ReduceOp::SUM: result = ReduceOp::Sum; break;
    case c10d::ReduceOp::AVG: result = ReduceOp::Avg; break;
    case c10d::ReduceOp::PRODUCT: result = ReduceOp::Product; break;
    case c10d::ReduceOp::MIN: result = ReduceOp::Min; break;
    case c10d::ReduceOp::MAX: result = ReduceOp::Max; break;
    case c10d::ReduceOp::BAND: result = ReduceOp::BitAnd; break;
    case c10d::ReduceOp::BOR: result = ReduceOp::BitOr; break;
    case c10d::ReduceOp::BXOR: result = ReduceOp::BitXor; break;
    case c10d::ReduceOp::PREMUL_SUM:  // a sum after premultiplied()
      TORCH_CHECK_TYPE(dtype == DataType::Float32 || dtype == DataType::Float64 || dtype == DataType::Float16 ||
                           dtype == DataType::BFloat16,
                       "ddlcomm: PREMUL_SUM needs a floating-point tensor, got ", dataTypeName(dtype));
      result = ReduceOp::Sum;
      break;
    default: TORCH_CHECK_VALUE(false, "ddlcomm does not support ReduceOp ", int(op.op_));
  }
  try {
    checkReduceOpSupported(result, dtype);
  } catch (const Error& e) {
    TORCH_CHECK_TYPE(false, "ddlcomm: ", e.what());
  }
  return result;
}

// PREMUL_SUM's factor (a double or a one-element tensor) applied to a copy of `t`; `t`
// itself for every other op. The sum of the copies is then torch's sum(factor * x_r).
// NCCLPreMulSumSupplement: the name torch 2.11 has; torch 2.13 keeps it as an alias.
at::Tensor premultiplied(const c10d::ReduceOp& op, const at::Tensor& t) {
  if (op.op_ != c10d::ReduceOp::PREMUL_SUM) return t;
  const auto* supplement = dynamic_cast<const c10d::NCCLPreMulSumSupplement*>(op.supplement_.get());
  TORCH_CHECK_VALUE(supplement, "ddlcomm: PREMUL_SUM without its factor");
  if (supplement->tensor_factor.defined()) {
    return at::mul(t, supplement->tensor_factor.to(t.device(), t.scalar_type()).reshape({}));
  }
  return at::mul(t, supplement->double_factor);
}

void checkTensor(const at::Tensor& t, const char* role) {
  TORCH_CHECK_VALUE(t.defined(), "ddlcomm: ", role, " tensor is undefined");
  // Collectives reach this with host mirrors of CUDA tensors (DeviceStaging); point-to-point,
  // sparse and the native compressed all-reduce take CPU tensors only.
  TORCH_CHECK_VALUE(t.device().is_cpu(), "ddlcomm: ", role, " tensor is on ", t.device(),
                    "; this operation takes CPU tensors (collectives also take CUDA tensors; for a compressed "
                    "all-reduce of CUDA tensors use ddlcomm.compressed)");
  TORCH_CHECK_VALUE(t.layout() == at::kStrided, "ddlcomm: ", role, " tensor has layout ", t.layout(),
                    "; only dense (strided) tensors are supported");
  toDataType(t);
}

at::Tensor single(std::vector<at::Tensor>& tensors, const char* op) {
  TORCH_CHECK_VALUE(tensors.size() == 1, "ddlcomm ", op, " takes exactly one tensor per process, got ",
                    tensors.size());
  checkTensor(tensors[0], op);
  return tensors[0];
}

void checkCompressible(const at::Tensor& t, const char* op) {
  TORCH_CHECK_TYPE(t.scalar_type() == at::kFloat || t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16,
                   "ddlcomm ", op, " needs a torch.float32, torch.float16 or torch.bfloat16 tensor, got ",
                   dtypeName(t.scalar_type()));
  TORCH_CHECK_VALUE(t.layout() == at::kStrided, "ddlcomm ", op, " needs a dense tensor");
}

void checkResidual(const std::optional<at::Tensor>& r, int64_t numel, const char* which, c10::Device device) {
  if (!r) return;
  TORCH_CHECK_TYPE(r->scalar_type() == at::kFloat, "ddlcomm: the ", which, " must be torch.float32, got ",
                   dtypeName(r->scalar_type()));
  TORCH_CHECK_VALUE(r->device() == device, "ddlcomm: the ", which, " is on ", r->device(), ", the tensor on ", device);
  TORCH_CHECK_VALUE(r->layout() == at::kStrided && r->is_contiguous() && r->numel() == numel, "ddlcomm: the ", which,
                    " must be a contiguous float32 tensor of ", numel, " elements, got ", r->numel());
}

void checkReduceScatterShapes(const at::Tensor& output, const at::Tensor& input, int size) {
  TORCH_CHECK_TYPE(input.scalar_type() == output.scalar_type(), "ddlcomm compressed reduce-scatter: input ",
                   dtypeName(input.scalar_type()), " and output ", dtypeName(output.scalar_type()), " differ");
  TORCH_CHECK_VALUE(input.numel() == output.numel() * size, "ddlcomm compressed reduce-scatter: input of ",
                    input.numel(), " elements for an output of ", output.numel(), " on ", size, " ranks");
}

void checkSameType(const at::Tensor& a, const at::Tensor& b, const char* op) {
  TORCH_CHECK_TYPE(a.scalar_type() == b.scalar_type(), "ddlcomm ", op, ": input dtype ", dtypeName(a.scalar_type()),
                   " differs from output dtype ", dtypeName(b.scalar_type()));
}

// Non-contiguous tensors are handled through a contiguous copy that is written back.
at::Tensor staged(const at::Tensor& t) { return t.is_contiguous() ? t : t.contiguous(); }
void writeBack(at::Tensor& user, const at::Tensor& work) {
  if (!user.is_same(work)) user.copy_(work);
}

void checkRoot(int64_t root, int size) {
  TORCH_CHECK_VALUE(root >= 0 && root < size, "ddlcomm: root rank ", root, " is outside the group of size ", size);
}

}  // namespace ddlcomm::torch_glue
