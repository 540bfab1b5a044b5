// The collectives of ProcessGroupDdlcomm (declared in backend.h): argument checks on the
// calling thread, then the operation on the executor. CUDA tensors go through host mirrors
// first (DeviceStaging, via throughHost).
#include <ATen/Functions.h>
#include <c10/util/Exception.h>

#include <numeric>

#include "collectives/collectives.h"
#include "torch/backend.h"
#include "torch/tensor_args.h"

namespace ddlcomm::torch_glue {

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

void ProcessGroupDdlcomm::allreduceNow(at::Tensor tensor, const c10d::ReduceOp& op) {
  if (tensor.defined() && tensor.is_complex()) {  // as dist.all_reduce: the real view, for the ops that allow it
    TORCH_CHECK_VALUE(op.op_ == c10d::ReduceOp::SUM || op.op_ == c10d::ReduceOp::AVG ||
                          op.op_ == c10d::ReduceOp::PREMUL_SUM,
                      prefix_, "all_reduce does not support ReduceOp.",
                      reduceOpName(toReduceOp(op, DataType::Int64)),  // every op left is defined for int64
                      " on complex tensors");
    tensor = at::view_as_real(tensor);
  }
  std::vector<at::Tensor> tensors{std::move(tensor)};
  c10d::AllreduceOptions opts;
  opts.reduceOp = op;
  opts.asyncOp = false;
  allreduce(tensors, opts)->wait();
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

}  // namespace ddlcomm::torch_glue
