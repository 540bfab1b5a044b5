// All-reduce of a sparse COO tensor (DDP's gradients of nn.Embedding(sparse=True)), as gloo
// does it: every rank's coalesced indices and values are all-gathered, then summed in rank
// order and coalesced, so that the result is the same on every rank, and the same as gloo's.
#include <ATen/Functions.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <c10/util/Exception.h>

#include <algorithm>

#include "collectives/collectives.h"
#include "torch/backend.h"
#include "torch/tensor_args.h"

namespace ddlcomm::torch_glue {
namespace {

// Every rank's rows of `local` (same trailing shape everywhere), each rank's padded to the
// longest so that one fixed-size all-gather carries them; returns one tensor per rank.
std::vector<at::Tensor> allgatherRows(Communicator& comm, const at::Tensor& local, const std::vector<int64_t>& rows,
                                      int64_t maxRows) {
  std::vector<int64_t> shape = local.sizes().vec();
  shape[0] = maxRows;
  at::Tensor padded = at::zeros(shape, local.options());
  padded.narrow(0, 0, local.size(0)).copy_(local);
  shape.insert(shape.begin(), int64_t(rows.size()));
  at::Tensor gathered = at::empty(shape, local.options());
  ddlcomm::allgather(comm, padded.data_ptr(), gathered.data_ptr(), size_t(padded.numel()), toDataType(local));
  std::vector<at::Tensor> result;
  for (size_t r = 0; r < rows.size(); ++r) result.push_back(gathered[int64_t(r)].narrow(0, 0, rows[r]));
  return result;
}

}  // namespace

c10::intrusive_ptr<c10d::Work> ProcessGroupDdlcomm::allreduceSparse(at::Tensor& tensor,
                                                                    const c10d::AllreduceOptions& opts) {
  TORCH_CHECK_VALUE(tensor.layout() == at::kSparse, "ddlcomm: sparse all-reduce of a ", tensor.layout(), " tensor");
  TORCH_CHECK_VALUE(tensor.device().is_cpu(), "ddlcomm: sparse tensor is on ", tensor.device(),
                    "; this build of ddlcomm handles CPU tensors only");
  TORCH_CHECK_VALUE(opts.reduceOp == c10d::ReduceOp::SUM, "ddlcomm: a sparse all-reduce only sums (as on gloo)");
  toDataType(tensor);
  return enqueue(c10d::OpType::ALLREDUCE, {tensor}, [tensor](Communicator& comm) mutable {
    at::AutoDispatchBelowAutograd noAutograd;  // as gloo: gradients are variables
    const at::Tensor input = tensor.coalesce();
    int64_t nnz = input._nnz();
    const int n = comm.size();
    at::Tensor counts = at::empty({n}, at::kLong);
    ddlcomm::allgather(comm, &nnz, counts.data_ptr(), 1, DataType::Int64);
    std::vector<int64_t> rows(counts.data_ptr<int64_t>(), counts.data_ptr<int64_t>() + n);
    const int64_t maxRows = *std::max_element(rows.begin(), rows.end());
    // Indices are [sparse dims, nnz]: gathered as rows of their transpose.
    auto indices = allgatherRows(comm, input._indices().t().contiguous(), rows, maxRows);
    auto values = allgatherRows(comm, input._values().contiguous(), rows, maxRows);
    at::Tensor output;
    for (int r = 0; r < n; ++r) {
      at::Tensor part = at::sparse_coo_tensor(indices[size_t(r)].t(), values[size_t(r)], input.sizes(), input.options());
      if (r == 0) output = part; else output.add_(part);
    }
    tensor.copy_(output.coalesce());
  });
}

}  // namespace ddlcomm::torch_glue
