#include "torch/backend.h"

#include <ATen/Functions.h>
#include <c10/util/Exception.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <future>
#include <numeric>
#include <optional>

#include "collectives/collectives.h"
#include "common/env.h"
#include "collectives/compressed_allreduce.h"
#include "compress/parallel.h"
#include "transport/connect.h"

namespace ddlcomm::torch_glue {
namespace {

class StoreAdapter final : public KeyValueStore {
 public:
  explicit StoreAdapter(c10::intrusive_ptr<c10d::Store> store) : store_(std::move(store)) {}
  void set(const std::string& key, const std::string& value) override {
    store_->set(key, std::vector<uint8_t>(value.begin(), value.end()));
  }
  std::string get(const std::string& key) override {
    auto value = store_->get(key);
    return std::string(value.begin(), value.end());
  }
  bool check(const std::string& key) override { return store_->check({key}); }

 private:
  c10::intrusive_ptr<c10d::Store> store_;
};

// torch's name of a dtype ("torch.int16"), which users know, rather than c10's ("Short").
std::string dtypeName(at::ScalarType type) { return c10::str("torch.", c10::getDtypeNames(type).first); }

}  // namespace

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

namespace {

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

std::exception_ptr toTorchException(std::exception_ptr error, const std::string& prefix) {
  try {
    std::rethrow_exception(error);
  } catch (const Error& e) {
    std::string message = prefix + e.what();
    try {
      switch (e.kind()) {
        case ErrorKind::InvalidArgument: TORCH_CHECK_VALUE(false, message);
        case ErrorKind::UnsupportedType: TORCH_CHECK_TYPE(false, message);
        default: C10_THROW_ERROR(DistBackendError, message);
      }
    } catch (...) {
      return std::current_exception();
    }
  } catch (...) {
    return std::current_exception();
  }
}

}  // namespace

// The GPUs of a Work's outputs: its future then records an event there when it completes,
// so that callbacks and waiters order their streams after it (torch's CUDA future semantics).
std::vector<c10::Device> cudaDevices(const std::vector<at::Tensor>& tensors) {
  std::vector<c10::Device> devices;
  for (const auto& t : tensors) {
    if (t.defined() && t.is_cuda() && std::find(devices.begin(), devices.end(), t.device()) == devices.end()) {
      devices.push_back(t.device());
    }
  }
  return devices;
}

DdlcommWork::DdlcommWork(int rank, c10d::OpType type, std::vector<at::Tensor> outputs, std::string prefix)
    : Work(rank, type),
      outputs_(std::move(outputs)),
      future_(c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()),
                                                       cudaDevices(outputs_))),
      prefix_(std::move(prefix)) {}

void DdlcommWork::complete(std::exception_ptr error) {
  if (error) {
    error = toTorchException(error, prefix_);
    future_->setError(error);
  } else {
    future_->markCompleted(c10::IValue(outputs_));
  }
  finish(error);
}

ProcessGroupDdlcomm::ProcessGroupDdlcomm(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                         std::chrono::milliseconds timeout, std::vector<int64_t> globalRanks,
                                         std::string groupName)
    : Backend(rank, size), store_(store), timeoutMs_(timeout.count()) {
  prefix_ = c10::str("[ddlcomm rank ", rank, "/", size);
  if (!globalRanks.empty() && size_t(rank) < globalRanks.size() && globalRanks[size_t(rank)] != rank) {
    prefix_ += c10::str(" of group '", groupName, "', global rank ", globalRanks[size_t(rank)]);
  }
  prefix_ += "] ";
  auto kv = std::make_shared<StoreAdapter>(store);
  try {
    // Every setting is read before connecting: a bad value fails at once, not after the peers joined.
    auto transportOptions = TransportOptions::fromEnvironment(timeout);
    auto collectiveOptions = CollectiveOptions::fromEnvironment(timeout);
    inlineBytes_ = size_t(envInteger("DDLCOMM_INLINE_BYTES", int64_t(inlineBytes_), 0));
    compress::configuredThreads();  // read again by every compressed call
    auto transport = connectTransport(rank, size, *kv, transportOptions);
    auto comm = std::make_unique<Communicator>(std::move(transport), kv, collectiveOptions);
    executor_ = std::make_unique<Executor>(std::move(comm));
  } catch (const Error& e) {
    if (e.kind() == ErrorKind::InvalidArgument) TORCH_CHECK_VALUE(false, prefix_, e.what());
    C10_THROW_ERROR(DistBackendError, prefix_ + "could not connect the group: " + e.what());
  }
}

ProcessGroupDdlcomm::~ProcessGroupDdlcomm() {
  if (executor_->onOwningThread()) {
    // The last reference went away in a completion callback, on the executor's thread or an
    // inline caller it waits for: joining it from here would deadlock. It is stopped and left
    // to finish by itself, and its memory is not reclaimed (this happens at exit, in practice).
    executor_->stop();
    (void)executor_.release();
    return;
  }
  // Python may drop the last reference with the GIL held, while the progress thread needs
  // the GIL to free the Python object of a tensor it still holds: join without the GIL.
  std::optional<pybind11::gil_scoped_release> noGil;
  if (Py_IsInitialized() && PyGILState_Check()) noGil.emplace();
  executor_->shutdown();
}

void ProcessGroupDdlcomm::abort() { executor_->abort("abort() was called"); executor_->shutdown(); }
void ProcessGroupDdlcomm::shutdown() { executor_->shutdown(); }

GroupStats ProcessGroupDdlcomm::stats() {
  auto snapshot = std::make_shared<std::promise<GroupStats>>();
  auto result = snapshot->get_future();
  auto taken = std::make_shared<GroupStats>();
  executor_->submit([taken](Communicator& comm) { *taken = comm.stats(); },
                    [snapshot, taken](std::exception_ptr error) {
                      if (error) snapshot->set_exception(error); else snapshot->set_value(*taken);
                    });
  try {
    return result.get();
  } catch (const Error& e) {
    C10_THROW_ERROR(DistBackendError, prefix_ + e.what());
  }
}

c10::intrusive_ptr<c10d::Work> ProcessGroupDdlcomm::allreduce(std::vector<at::Tensor>& tensors,
                                                              const c10d::AllreduceOptions& opts) {
  if (tensors.size() == 1 && tensors[0].defined() && tensors[0].is_sparse()) return allreduceSparse(tensors[0], opts);
  if (DeviceStaging::needed(tensors)) {
    auto staging = std::make_shared<DeviceStaging>();
    auto a0 = staging->inplace(tensors);
    return throughHost(c10d::OpType::ALLREDUCE, staging, [&] { return allreduce(a0, opts); });
  }
  at::Tensor user = single(tensors, "allreduce");
  const DataType dtype = toDataType(user);
  const ReduceOp op = toReduceOp(opts.reduceOp, dtype);
  return enqueue(c10d::OpType::ALLREDUCE, !opts.asyncOp, tensors, [user, dtype, op, redop = opts.reduceOp](Communicator& comm) mutable {
    at::Tensor work = premultiplied(redop, staged(user));
    ddlcomm::allreduce(comm, work.data_ptr(), size_t(work.numel()), dtype, op);
    writeBack(user, work);
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupDdlcomm::allreduce_coalesced(
    std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) {
  if (DeviceStaging::needed(tensors)) {
    auto staging = std::make_shared<DeviceStaging>();
    auto a0 = staging->inplace(tensors);
    return throughHost(c10d::OpType::ALLREDUCE_COALESCED, staging, [&] { return allreduce_coalesced(a0, opts); });
  }
  TORCH_CHECK_VALUE(!tensors.empty(), "ddlcomm allreduce_coalesced needs at least one tensor");
  for (const auto& t : tensors) {
    checkTensor(t, "allreduce_coalesced");
    checkSameType(tensors[0], t, "allreduce_coalesced");
  }
  const DataType dtype = toDataType(tensors[0]);
  const ReduceOp op = toReduceOp(opts.reduceOp, dtype);
  return enqueue(c10d::OpType::ALLREDUCE_COALESCED, tensors,
                 [tensors, dtype, op, redop = opts.reduceOp](Communicator& comm) mutable {
    // One flat buffer, one collective: a single pipeline instead of many small ones.
    std::vector<at::Tensor> flat;
    for (const auto& t : tensors) flat.push_back(t.reshape({-1}));
    at::Tensor buffer = premultiplied(redop, at::cat(flat));
    ddlcomm::allreduce(comm, buffer.data_ptr(), size_t(buffer.numel()), dtype, op);
    int64_t offset = 0;
    for (auto& t : tensors) {
      t.copy_(buffer.narrow(0, offset, t.numel()).view(t.sizes()));
      offset += t.numel();
    }
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupDdlcomm::broadcast(std::vector<at::Tensor>& tensors,
                                                              const c10d::BroadcastOptions& opts) {
  if (DeviceStaging::needed(tensors)) {
    auto staging = std::make_shared<DeviceStaging>();
    auto a0 = staging->inplace(tensors);
    return throughHost(c10d::OpType::BROADCAST, staging, [&] { return broadcast(a0, opts); });
  }
  at::Tensor user = single(tensors, "broadcast");
  checkRoot(opts.rootRank, size_);
  const DataType dtype = toDataType(user);
  const int root = int(opts.rootRank);
  return enqueue(c10d::OpType::BROADCAST, !opts.asyncOp, tensors, [user, dtype, root](Communicator& comm) mutable {
    at::Tensor work = staged(user);
    ddlcomm::broadcast(comm, work.data_ptr(), size_t(work.numel()), dtype, root);
    writeBack(user, work);
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupDdlcomm::reduce(std::vector<at::Tensor>& tensors,
                                                           const c10d::ReduceOptions& opts) {
  if (DeviceStaging::needed(tensors)) {
    auto staging = std::make_shared<DeviceStaging>();
    auto a0 = staging->inplace(tensors);
    return throughHost(c10d::OpType::REDUCE, staging, [&] { return reduce(a0, opts); });
  }
  at::Tensor user = single(tensors, "reduce");
  checkRoot(opts.rootRank, size_);
  const DataType dtype = toDataType(user);
  const ReduceOp op = toReduceOp(opts.reduceOp, dtype);
  const int root = int(opts.rootRank);
  return enqueue(c10d::OpType::REDUCE, !opts.asyncOp, tensors,
                 [user, dtype, op, root, redop = opts.reduceOp](Communicator& comm) mutable {
    at::Tensor work = premultiplied(redop, staged(user));
    ddlcomm::reduce(comm, work.data_ptr(), work.data_ptr(), size_t(work.numel()), dtype, op, root);
    if (comm.rank() == root) writeBack(user, work);
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupDdlcomm::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                                    const c10d::AllgatherOptions& opts) {
  if (DeviceStaging::needed({output, input})) {
    auto staging = std::make_shared<DeviceStaging>();
    auto a0 = staging->output(output);
    auto a1 = staging->input(input);
    return throughHost(c10d::OpType::_ALLGATHER_BASE, staging, [&] { return _allgather_base(a0, a1, opts); });
  }
  checkTensor(output, "all_gather_into_tensor output");
  checkTensor(input, "all_gather_into_tensor input");
  checkSameType(input, output, "all_gather_into_tensor");
  TORCH_CHECK_VALUE(output.numel() == input.numel() * size_, "ddlcomm all_gather_into_tensor: output has ",
                    output.numel(), " elements, expected ", input.numel(), " x ", size_);
  const DataType dtype = toDataType(input);
  return enqueue(c10d::OpType::_ALLGATHER_BASE, !opts.asyncOp, {output}, [output, input, dtype](Communicator& comm) mutable {
    at::Tensor out = staged(output), in = input.contiguous();
    ddlcomm::allgather(comm, in.data_ptr(), out.data_ptr(), size_t(in.numel()), dtype);
    writeBack(output, out);
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupDdlcomm::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                              std::vector<at::Tensor>& inputs,
                                                              const c10d::AllgatherOptions& opts) {
  if (DeviceStaging::needed(outputs) || DeviceStaging::needed(inputs)) {
    auto staging = std::make_shared<DeviceStaging>();
    auto a0 = staging->output(outputs);
    auto a1 = staging->input(inputs);
    return throughHost(c10d::OpType::ALLGATHER, staging, [&] { return allgather(a0, a1, opts); });
  }
  at::Tensor input = single(inputs, "allgather");
  TORCH_CHECK_VALUE(outputs.size() == 1 && outputs[0].size() == size_t(size_), "ddlcomm allgather needs one output list of ",
                    size_, " tensors");
  for (const auto& t : outputs[0]) {
    checkTensor(t, "allgather output");
    checkSameType(input, t, "allgather");
    TORCH_CHECK_VALUE(t.numel() == input.numel(), "ddlcomm allgather: output tensors must have the input's ",
                      input.numel(), " elements, got ", t.numel());
  }
  const DataType dtype = toDataType(input);
  std::vector<at::Tensor> outs = outputs[0];
  return enqueue(c10d::OpType::ALLGATHER, !opts.asyncOp, outs, [outs, input, dtype](Communicator& comm) mutable {
    at::Tensor in = input.contiguous();
    at::Tensor flat = at::empty({int64_t(outs.size()) * in.numel()}, in.options());
    ddlcomm::allgather(comm, in.data_ptr(), flat.data_ptr(), size_t(in.numel()), dtype);
    for (size_t i = 0; i < outs.size(); ++i) {
      outs[i].copy_(flat.narrow(0, int64_t(i) * in.numel(), in.numel()).view(outs[i].sizes()));
    }
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupDdlcomm::allgather_coalesced(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs, const c10d::AllgatherOptions& opts) {
  if (DeviceStaging::needed(outputs) || DeviceStaging::needed(inputs)) {
    auto staging = std::make_shared<DeviceStaging>();
    auto a0 = staging->output(outputs);
    auto a1 = staging->input(inputs);
    return throughHost(c10d::OpType::ALLGATHER_COALESCED, staging, [&] { return allgather_coalesced(a0, a1, opts); });
  }
  // As in torch's API: outputs[r][i] receives rank r's inputs[i].
  TORCH_CHECK_VALUE(!inputs.empty(), "ddlcomm allgather_coalesced needs at least one input tensor");
  TORCH_CHECK_VALUE(outputs.size() == size_t(size_), "ddlcomm allgather_coalesced: ", outputs.size(),
                    " output lists, expected one per rank (", size_, ")");
  std::vector<at::Tensor> all;
  for (const auto& list : outputs) {
    TORCH_CHECK_VALUE(list.size() == inputs.size(), "ddlcomm allgather_coalesced: an output list has ", list.size(),
                      " tensors, expected one per input (", inputs.size(), ")");
    for (size_t i = 0; i < inputs.size(); ++i) {
      checkTensor(inputs[i], "allgather_coalesced input");
      checkTensor(list[i], "allgather_coalesced output");
      checkSameType(inputs[i], list[i], "allgather_coalesced");
      TORCH_CHECK_VALUE(list[i].numel() == inputs[i].numel(), "ddlcomm allgather_coalesced: output tensor ", i,
                        " has ", list[i].numel(), " elements, its input ", inputs[i].numel());
      all.push_back(list[i]);
    }
  }
  return enqueue(c10d::OpType::ALLGATHER_COALESCED, all, [outputs, inputs](Communicator& comm) mutable {
    for (size_t i = 0; i < inputs.size(); ++i) {
      at::Tensor in = inputs[i].contiguous();
      at::Tensor flat = at::empty({int64_t(outputs.size()) * in.numel()}, in.options());
      ddlcomm::allgather(comm, in.data_ptr(), flat.data_ptr(), size_t(in.numel()), toDataType(in));
      for (size_t r = 0; r < outputs.size(); ++r) {
        outputs[r][i].copy_(flat.narrow(0, int64_t(r) * in.numel(), in.numel()).view(outputs[r][i].sizes()));
      }
    }
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupDdlcomm::allgather_into_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs, const c10d::AllgatherOptions& opts) {
  if (DeviceStaging::needed(outputs) || DeviceStaging::needed(inputs)) {
    auto staging = std::make_shared<DeviceStaging>();
    auto a0 = staging->output(outputs);
    auto a1 = staging->input(inputs);
    return throughHost(c10d::OpType::COALESCED, staging, [&] { return allgather_into_tensor_coalesced(a0, a1, opts); });
  }
  TORCH_CHECK_VALUE(outputs.size() == inputs.size(), "ddlcomm allgather_into_tensor_coalesced: ", outputs.size(),
                    " outputs for ", inputs.size(), " inputs");
  for (size_t i = 0; i < inputs.size(); ++i) {
    checkTensor(inputs[i], "all_gather_into_tensor input");
    checkTensor(outputs[i], "all_gather_into_tensor output");
    checkSameType(inputs[i], outputs[i], "all_gather_into_tensor");
    TORCH_CHECK_VALUE(outputs[i].numel() == inputs[i].numel() * size_, "ddlcomm all_gather_into_tensor: output has ",
                      outputs[i].numel(), " elements, expected ", inputs[i].numel(), " x ", size_);
  }
  return enqueue(c10d::OpType::COALESCED, outputs, [outputs, inputs](Communicator& comm) mutable {
    for (size_t i = 0; i < inputs.size(); ++i) {
      at::Tensor out = staged(outputs[i]), in = inputs[i].contiguous();
      ddlcomm::allgather(comm, in.data_ptr(), out.data_ptr(), size_t(in.numel()), toDataType(in));
      writeBack(outputs[i], out);
    }
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupDdlcomm::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                                         const c10d::ReduceScatterOptions& opts) {
  if (DeviceStaging::needed({output, input})) {
    auto staging = std::make_shared<DeviceStaging>();
    auto a0 = staging->output(output);
    auto a1 = staging->input(input);
    return throughHost(c10d::OpType::_REDUCE_SCATTER_BASE, staging, [&] { return _reduce_scatter_base(a0, a1, opts); });
  }
  checkTensor(output, "reduce_scatter_tensor output");
  checkTensor(input, "reduce_scatter_tensor input");
  checkSameType(input, output, "reduce_scatter_tensor");
  TORCH_CHECK_VALUE(input.numel() == output.numel() * size_, "ddlcomm reduce_scatter_tensor: input has ",
                    input.numel(), " elements, expected ", output.numel(), " x ", size_);
  const DataType dtype = toDataType(input);
  const ReduceOp op = toReduceOp(opts.reduceOp, dtype);
  return enqueue(c10d::OpType::_REDUCE_SCATTER_BASE, !opts.asyncOp, {output},
                 [output, input, dtype, op, redop = opts.reduceOp](Communicator& comm) mutable {
    at::Tensor out = staged(output), in = premultiplied(redop, input.contiguous());
    ddlcomm::reduceScatter(comm, in.data_ptr(), out.data_ptr(), size_t(out.numel()), dtype, op);
    writeBack(output, out);
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupDdlcomm::reduce_scatter(std::vector<at::Tensor>& outputs,
                                                                   std::vector<std::vector<at::Tensor>>& inputs,
                                                                   const c10d::ReduceScatterOptions& opts) {
  if (DeviceStaging::needed(outputs) || DeviceStaging::needed(inputs)) {
    auto staging = std::make_shared<DeviceStaging>();
    auto a0 = staging->output(outputs);
    auto a1 = staging->input(inputs);
    return throughHost(c10d::OpType::REDUCE_SCATTER, staging, [&] { return reduce_scatter(a0, a1, opts); });
  }
  at::Tensor output = single(outputs, "reduce_scatter");
  TORCH_CHECK_VALUE(inputs.size() == 1 && inputs[0].size() == size_t(size_), "ddlcomm reduce_scatter needs one input list of ",
                    size_, " tensors");
  for (const auto& t : inputs[0]) {
    checkTensor(t, "reduce_scatter input");
    checkSameType(output, t, "reduce_scatter");
    TORCH_CHECK_VALUE(t.numel() == output.numel(), "ddlcomm reduce_scatter: input tensors must have the output's ",
                      output.numel(), " elements, got ", t.numel());
  }
  const DataType dtype = toDataType(output);
  const ReduceOp op = toReduceOp(opts.reduceOp, dtype);
  std::vector<at::Tensor> ins = inputs[0];
  return enqueue(c10d::OpType::REDUCE_SCATTER, !opts.asyncOp, outputs,
                 [output, ins, dtype, op, redop = opts.reduceOp](Communicator& comm) mutable {
    std::vector<at::Tensor> flat;
    for (const auto& t : ins) flat.push_back(t.reshape({-1}));
    at::Tensor in = premultiplied(redop, at::cat(flat));
    at::Tensor out = staged(output);
    ddlcomm::reduceScatter(comm, in.data_ptr(), out.data_ptr(), size_t(out.numel()), dtype, op);
    writeBack(output, out);
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupDdlcomm::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs, const c10d::ReduceScatterOptions& opts) {
  if (DeviceStaging::needed(outputs) || DeviceStaging::needed(inputs)) {
    auto staging = std::make_shared<DeviceStaging>();
    auto a0 = staging->output(outputs);
    auto a1 = staging->input(inputs);
    return throughHost(c10d::OpType::COALESCED, staging, [&] { return reduce_scatter_tensor_coalesced(a0, a1, opts); });
  }
  TORCH_CHECK_VALUE(outputs.size() == inputs.size(), "ddlcomm reduce_scatter_tensor_coalesced: ", outputs.size(),
                    " outputs for ", inputs.size(), " inputs");
  std::vector<ReduceOp> ops;
  for (size_t i = 0; i < inputs.size(); ++i) {
    checkTensor(inputs[i], "reduce_scatter_tensor input");
    checkTensor(outputs[i], "reduce_scatter_tensor output");
    checkSameType(inputs[i], outputs[i], "reduce_scatter_tensor");
    TORCH_CHECK_VALUE(inputs[i].numel() == outputs[i].numel() * size_, "ddlcomm reduce_scatter_tensor: size mismatch");
    ops.push_back(toReduceOp(opts.reduceOp, toDataType(inputs[i])));
  }
  return enqueue(c10d::OpType::COALESCED, outputs,
                 [outputs, inputs, ops, redop = opts.reduceOp](Communicator& comm) mutable {
    for (size_t i = 0; i < inputs.size(); ++i) {
      at::Tensor out = staged(outputs[i]), in = premultiplied(redop, inputs[i].contiguous());
      ddlcomm::reduceScatter(comm, in.data_ptr(), out.data_ptr(), size_t(out.numel()), toDataType(in), ops[i]);
      writeBack(outputs[i], out);
    }
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupDdlcomm::alltoall_base(at::Tensor& output, at::Tensor& input,
                                                                  std::vector<int64_t>& outputSplitSizes,
                                                                  std::vector<int64_t>& inputSplitSizes,
                                                                  const c10d::AllToAllOptions& opts) {
  if (DeviceStaging::needed({output, input})) {
    auto staging = std::make_shared<DeviceStaging>();
    auto a0 = staging->output(output);
    auto a1 = staging->input(input);
    return throughHost(c10d::OpType::ALLTOALL_BASE, staging, [&] { return alltoall_base(a0, a1, outputSplitSizes, inputSplitSizes, opts); });
  }
  checkTensor(output, "all_to_all_single output");
  checkTensor(input, "all_to_all_single input");
  checkSameType(input, output, "all_to_all_single");
  // Splits count rows (dim 0); a row holds numel / size(0) elements.
  auto counts = [&](const at::Tensor& t, const std::vector<int64_t>& splits, const char* which) {
    std::vector<size_t> result(static_cast<size_t>(size_));
    const int64_t rows = t.dim() == 0 ? 1 : t.size(0);
    const int64_t rowElems = rows == 0 ? 0 : t.numel() / rows;
    if (splits.empty()) {
      TORCH_CHECK_VALUE(rows % size_ == 0, "ddlcomm all_to_all_single: ", which, " dim 0 (", rows,
                        ") is not divisible by the group size ", size_, "; pass split sizes");
      for (auto& c : result) c = size_t(rows / size_ * rowElems);
    } else {
      TORCH_CHECK_VALUE(splits.size() == size_t(size_), "ddlcomm all_to_all_single: ", which, " split sizes need ",
                        size_, " entries, got ", splits.size());
      TORCH_CHECK_VALUE(std::accumulate(splits.begin(), splits.end(), int64_t(0)) == rows, "ddlcomm all_to_all_single: ",
                        which, " split sizes do not add up to dim 0 (", rows, ")");
      for (size_t i = 0; i < splits.size(); ++i) result[i] = size_t(splits[i] * rowElems);
    }
    return result;
  };
  std::vector<size_t> sendCounts = counts(input, inputSplitSizes, "input");
  std::vector<size_t> recvCounts = counts(output, outputSplitSizes, "output");
  const DataType dtype = toDataType(input);
  return enqueue(c10d::OpType::ALLTOALL_BASE, !opts.asyncOp, {output},
                 [output, input, sendCounts, recvCounts, dtype](Communicator& comm) mutable {
                   at::Tensor out = staged(output), in = input.contiguous();
                   ddlcomm::allToAll(comm, in.data_ptr(), sendCounts, out.data_ptr(), recvCounts, dtype);
                   writeBack(output, out);
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupDdlcomm::alltoall(std::vector<at::Tensor>& outputs,
                                                             std::vector<at::Tensor>& inputs,
                                                             const c10d::AllToAllOptions& opts) {
  if (DeviceStaging::needed(outputs) || DeviceStaging::needed(inputs)) {
    auto staging = std::make_shared<DeviceStaging>();
    auto a0 = staging->output(outputs);
    auto a1 = staging->input(inputs);
    return throughHost(c10d::OpType::ALLTOALL, staging, [&] { return alltoall(a0, a1, opts); });
  }
  TORCH_CHECK_VALUE(outputs.size() == size_t(size_) && inputs.size() == size_t(size_),
                    "ddlcomm all_to_all needs ", size_, " input and output tensors");
  std::vector<size_t> sendCounts, recvCounts;
  for (int i = 0; i < size_; ++i) {
    checkTensor(inputs[size_t(i)], "all_to_all input");
    checkTensor(outputs[size_t(i)], "all_to_all output");
    checkSameType(inputs[0], inputs[size_t(i)], "all_to_all");
    checkSameType(inputs[0], outputs[size_t(i)], "all_to_all");
    sendCounts.push_back(size_t(inputs[size_t(i)].numel()));
    recvCounts.push_back(size_t(outputs[size_t(i)].numel()));
  }
  const DataType dtype = toDataType(inputs[0]);
  return enqueue(c10d::OpType::ALLTOALL, outputs,
                 [outputs, inputs, sendCounts, recvCounts, dtype](Communicator& comm) mutable {
                   std::vector<at::Tensor> flatIn;
                   for (const auto& t : inputs) flatIn.push_back(t.reshape({-1}));
                   at::Tensor in = at::cat(flatIn);
                   at::Tensor out = at::empty({int64_t(std::accumulate(recvCounts.begin(), recvCounts.end(), size_t(0)))},
                                              in.options());
                   ddlcomm::allToAll(comm, in.data_ptr(), sendCounts, out.data_ptr(), recvCounts, dtype);
                   int64_t offset = 0;
                   for (auto& t : outputs) {
                     t.copy_(out.narrow(0, offset, t.numel()).view(t.sizes()));
                     offset += t.numel();
                   }
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupDdlcomm::gather(std::vector<std::vector<at::Tensor>>& outputs,
                                                           std::vector<at::Tensor>& inputs,
                                                           const c10d::GatherOptions& opts) {
  if (DeviceStaging::needed(outputs) || DeviceStaging::needed(inputs)) {
    auto staging = std::make_shared<DeviceStaging>();
    auto a0 = staging->output(outputs);
    auto a1 = staging->input(inputs);
    return throughHost(c10d::OpType::GATHER, staging, [&] { return gather(a0, a1, opts); });
  }
  at::Tensor input = single(inputs, "gather");
  checkRoot(opts.rootRank, size_);
  const int root = int(opts.rootRank);
  std::vector<at::Tensor> outs;
  if (rank_ == root) {
    TORCH_CHECK_VALUE(outputs.size() == 1 && outputs[0].size() == size_t(size_), "ddlcomm gather: root needs a list of ",
                      size_, " output tensors");
    for (const auto& t : outputs[0]) {
      checkTensor(t, "gather output");
      checkSameType(input, t, "gather");
      TORCH_CHECK_VALUE(t.numel() == input.numel(), "ddlcomm gather: output tensors must match the input size");
    }
    outs = outputs[0];
  } else {
    TORCH_CHECK_VALUE(outputs.empty() || outputs[0].empty(), "ddlcomm gather: only the root passes output tensors");
  }
  const DataType dtype = toDataType(input);
  return enqueue(c10d::OpType::GATHER, outs, [outs, input, dtype, root](Communicator& comm) mutable {
    at::Tensor in = input.contiguous();
    at::Tensor flat;
    if (comm.rank() == root) flat = at::empty({int64_t(outs.size()) * in.numel()}, in.options());
    ddlcomm::gather(comm, in.data_ptr(), flat.defined() ? flat.data_ptr() : nullptr, size_t(in.numel()), dtype, root);
    for (size_t i = 0; i < outs.size(); ++i) {
      outs[i].copy_(flat.narrow(0, int64_t(i) * in.numel(), in.numel()).view(outs[i].sizes()));
    }
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupDdlcomm::scatter(std::vector<at::Tensor>& outputs,
                                                            std::vector<std::vector<at::Tensor>>& inputs,
                                                            const c10d::ScatterOptions& opts) {
  if (DeviceStaging::needed(outputs) || DeviceStaging::needed(inputs)) {
    auto staging = std::make_shared<DeviceStaging>();
    auto a0 = staging->output(outputs);
    auto a1 = staging->input(inputs);
    return throughHost(c10d::OpType::SCATTER, staging, [&] { return scatter(a0, a1, opts); });
  }
  at::Tensor output = single(outputs, "scatter");
  checkRoot(opts.rootRank, size_);
  const int root = int(opts.rootRank);
  std::vector<at::Tensor> ins;
  if (rank_ == root) {
    TORCH_CHECK_VALUE(inputs.size() == 1 && inputs[0].size() == size_t(size_), "ddlcomm scatter: root needs a list of ",
                      size_, " input tensors");
    for (const auto& t : inputs[0]) {
      checkTensor(t, "scatter input");
      checkSameType(output, t, "scatter");
      TORCH_CHECK_VALUE(t.numel() == output.numel(), "ddlcomm scatter: input tensors must match the output size");
    }
    ins = inputs[0];
  } else {
    TORCH_CHECK_VALUE(inputs.empty() || inputs[0].empty(), "ddlcomm scatter: only the root passes input tensors");
  }
  const DataType dtype = toDataType(output);
  return enqueue(c10d::OpType::SCATTER, outputs, [output, ins, dtype, root](Communicator& comm) mutable {
    at::Tensor out = staged(output);
    at::Tensor flat;
    if (comm.rank() == root) {
      std::vector<at::Tensor> parts;
      for (const auto& t : ins) parts.push_back(t.reshape({-1}));
      flat = at::cat(parts);
    }
    ddlcomm::scatter(comm, flat.defined() ? flat.data_ptr() : nullptr, out.data_ptr(), size_t(out.numel()), dtype, root);
    writeBack(output, out);
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupDdlcomm::barrier(const c10d::BarrierOptions&) {
  return enqueue(c10d::OpType::BARRIER, {}, [](Communicator& comm) { ddlcomm::barrier(comm); });
}

int64_t ProcessGroupDdlcomm::serverResidualNumel(int64_t numel) const {
  return int64_t(serverResidualLength(size_t(numel), rank_, size_));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupDdlcomm::compressedAllreduce(at::Tensor& tensor,
                                                                        const compress::Config& config,
                                                                        std::optional<at::Tensor> workerResidual,
                                                                        std::optional<at::Tensor> serverResidual,
                                                                        bool average, uint64_t stream) {
  checkTensor(tensor, "compressed allreduce");
  TORCH_CHECK_TYPE(tensor.scalar_type() == at::kFloat || tensor.scalar_type() == at::kHalf ||
                       tensor.scalar_type() == at::kBFloat16,
                   "ddlcomm compressed allreduce needs a torch.float32, torch.float16 or torch.bfloat16 tensor, got ",
                   dtypeName(tensor.scalar_type()));
  auto checkResidual = [](const std::optional<at::Tensor>& r, int64_t numel, const char* which) {
    if (!r) return;
    checkTensor(*r, which);
    TORCH_CHECK_TYPE(r->scalar_type() == at::kFloat, "ddlcomm: the ", which, " must be torch.float32, got ",
                     dtypeName(r->scalar_type()));
    TORCH_CHECK_VALUE(r->is_contiguous() && r->numel() == numel, "ddlcomm: the ", which,
                      " must be a contiguous float32 tensor of ", numel, " elements, got ", r->numel());
  };
  checkResidual(workerResidual, tensor.numel(), "worker residual");
  checkResidual(serverResidual, serverResidualNumel(tensor.numel()), "server residual");
  const DataType dtype = toDataType(tensor);
  return enqueue(c10d::OpType::ALLREDUCE, {tensor},
                 [tensor, config, workerResidual, serverResidual, average, stream, dtype](Communicator& comm) mutable {
                   at::Tensor work = staged(tensor);
                   CompressedAllreduceArgs args;
                   args.config = config;
                   args.dtype = dtype;
                   args.data = work.data_ptr();
                   args.count = size_t(work.numel());
                   args.workerResidual = workerResidual ? workerResidual->data_ptr<float>() : nullptr;
                   args.serverResidual = serverResidual ? serverResidual->data_ptr<float>() : nullptr;
                   args.average = average;
                   args.stream = stream;
                   ddlcomm::compressedAllreduce(comm, args);
                   writeBack(tensor, work);
                 });
}

namespace {
// Keeps the tensor (and its contiguous staging copy) alive for an in-flight request.
struct PointToPoint {
  at::Tensor user;
  at::Tensor work;
  std::shared_ptr<Request> request = std::make_shared<Request>();
};
}  // namespace

c10::intrusive_ptr<c10d::Work> ProcessGroupDdlcomm::send(std::vector<at::Tensor>& tensors, int dstRank, int tag) {
  at::Tensor user = single(tensors, "send");
  TORCH_CHECK_VALUE(dstRank >= 0 && dstRank < size_ && dstRank != rank_, "ddlcomm send: invalid destination rank ",
                    dstRank, " from rank ", rank_, " in a group of ", size_);
  auto p2p = std::make_shared<PointToPoint>();
  p2p->user = user;
  p2p->work = user.contiguous();
  Request& r = *p2p->request;
  r.peer = dstRank;
  r.signature.op = OpCode::PointToPoint;
  r.signature.dtype = toDataType(user);
  r.signature.seq = uint64_t(uint32_t(tag));
  r.signature.count = uint64_t(user.numel());
  r.data = static_cast<char*>(p2p->work.data_ptr());
  r.bytes = size_t(p2p->work.nbytes());
  auto work = c10::make_intrusive<DdlcommWork>(rank_, c10d::OpType::SEND, tensors, prefix_);
  executor_->submitPointToPoint(p2p->request, true, [work, p2p](std::exception_ptr error) { work->complete(error); });
  trackCoalesced(work);
  return work;
}

c10::intrusive_ptr<c10d::Work> ProcessGroupDdlcomm::recv(std::vector<at::Tensor>& tensors, int srcRank, int tag) {
  TORCH_CHECK_VALUE(srcRank >= 0 && srcRank < size_ && srcRank != rank_, "ddlcomm recv: invalid source rank ",
                    srcRank, " at rank ", rank_, " in a group of ", size_);
  return postRecv(tensors, srcRank, tag);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupDdlcomm::recvAnysource(std::vector<at::Tensor>& tensors, int tag) {
  return postRecv(tensors, kAnySource, tag);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupDdlcomm::postRecv(std::vector<at::Tensor>& tensors, int srcRank, int tag) {
  at::Tensor user = single(tensors, "recv");
  auto p2p = std::make_shared<PointToPoint>();
  p2p->user = user;
  p2p->work = staged(user);
  Request& r = *p2p->request;
  r.peer = srcRank;
  r.signature.op = OpCode::PointToPoint;
  r.signature.dtype = toDataType(user);
  r.signature.seq = uint64_t(uint32_t(tag));
  r.signature.count = uint64_t(user.numel());
  r.data = static_cast<char*>(p2p->work.data_ptr());
  r.bytes = size_t(p2p->work.nbytes());
  auto work = c10::make_intrusive<DdlcommWork>(rank_, c10d::OpType::RECV, tensors, prefix_);
  executor_->submitPointToPoint(p2p->request, false, [work, p2p](std::exception_ptr error) {
    if (!error) {
      writeBack(p2p->user, p2p->work);
      work->setSourceRank(p2p->request->peer);  // the sender, for a receive from any rank
    }
    work->complete(error);
  });
  trackCoalesced(work);
  return work;
}

int DdlcommWork::sourceRank() const {
  const int rank = sourceRank_.load();
  TORCH_CHECK(rank >= 0, "ddlcomm: the source rank is known once a receive has completed");
  return rank;
}

}  // namespace ddlcomm::torch_glue
