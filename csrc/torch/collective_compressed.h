// The compressed all-reduce and reduce-scatter, the one implementation for every group and
// device: the plan of csrc/collectives/compressed_plan.h run over c10d backends' collectives
// (all-to-all and all-gather of the payloads; all-reduce and reduce-scatter for the exact sums
// inside a host). The backends are the adapters: a ddlcomm group's own (its transport; where
// the group's collectives run on the CPU a call is one operation on its executor), the ddlcomm
// backend over a gloo group's send and recv (the same, for that group), NCCL's, or any
// backend's called from the caller's thread (CompressedAllreduce).
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <optional>
#include <string>
#include <vector>

#include "compress/compress.h"
#include "torch/backend.h"

namespace ddlcomm::torch_glue {

// The collectives of one set of ranks: those of the tensor's values (the backend for the
// tensor's device) and those of the payloads (the same backend, or the group's CPU one where
// the payloads of a CUDA tensor are staged through host memory).
struct CollectiveLevel {
  c10::intrusive_ptr<c10d::Backend> values;
  c10::intrusive_ptr<c10d::Backend> payloads;
};

// A process group as the compressed all-reduce sees it.
struct CollectiveGroup {
  CollectiveLevel group;
  // Two levels over hosts (both or neither): the ranks of this rank's host, and the ranks at
  // its place on every host; `identities` (every group rank's host identity) give the plan.
  std::optional<CollectiveLevel> host, across;
  std::vector<std::string> identities;
  // The payloads cross to pinned host memory (a CUDA tensor over a CPU backend): copies
  // waited for by events, and what arrives validated on the host before it is decoded.
  bool staged = false;
};

struct CollectiveAllreduceArgs {
  compress::Config config;
  at::Tensor tensor;                       // float32, float16 or bfloat16; reduced in place
  std::optional<at::Tensor> workerResidual;  // float32[numel] on the tensor's device
  std::optional<at::Tensor> serverResidual;  // float32[serverResidualLength(...)]
  bool average = true;
  uint64_t stream = 0;
};

struct CollectiveReduceScatterArgs {
  compress::Config config;
  at::Tensor output;                         // m elements: this rank's chunk of the reduction
  at::Tensor input;                          // n * m elements, of the output's dtype
  std::optional<at::Tensor> workerResidual;  // float32[n * m] on the tensors' device
  bool average = true;
  uint64_t stream = 0;
};

// The compressed reduce-scatter: chunk o of the input, encoded with its worker residual and
// randomness stream encodeStream(stream, rank, 0, o, n, 0), goes to rank o in one all-to-all;
// each rank sums what it receives in float32 in rank order, scales it for an average and
// writes it in the output's dtype. Over two levels, the host's exact reduce-scatter first (of
// the chunks of the ranks at each place on every host, in the tensors' dtype), then the same
// among the ranks at this rank's place, whose residuals hold that host sum's error.
void compressedReduceScatterOverCollectives(const CollectiveGroup& group, const CollectiveReduceScatterArgs& args);

// The compressed all-reduce bound to a group and a compressor: over which collectives, and
// where it runs. With an `engine` (a ddlcomm backend: a ddlcomm group's own, or one over a gloo
// group's send and recv, ProcessGroupDdlcomm.over), as one operation on its executor, in order
// with the group's others, whose collectives (the engine's own, and the two levels' where the
// group takes them) run inline on the executor thread; a CUDA tensor's kernels then run on a
// stream of torch's pool after the caller's stream, its payloads through pinned host memory
// (DeviceWork). Without one, on the caller's thread: kernels and device copies on the current
// stream of the tensor's device, which a backend whose collectives run there (NCCL) orders,
// so nothing waits on the host. Made once per group, device and compressor
// (ddlcomm.compressed.route_of); a DDP hook starts it once per bucket. Every rank ends with
// the same bits.
class CompressedAllreduce {
 public:
  CompressedAllreduce(compress::Config config, CollectiveGroup group, c10::intrusive_ptr<ProcessGroupDdlcomm> engine);

  // All-reduces `tensor` in place: returns at once (on the caller's thread, once its work is
  // issued), its arguments checked, with a Work whose future holds [tensor].
  c10::intrusive_ptr<c10d::Work> start(at::Tensor tensor, std::optional<at::Tensor> workerResidual,
                                       std::optional<at::Tensor> serverResidual, bool average, uint64_t stream) const;

 private:
  compress::Config config_;
  CollectiveGroup group_;  // for an engine: the two levels (its own collectives are the group's)
  c10::intrusive_ptr<ProcessGroupDdlcomm> engine_;
};

// The compressed reduce-scatter of CPU tensors on a ddlcomm backend's executor, as the
// all-reduce above; the Work's future holds [output].
c10::intrusive_ptr<c10d::Work> startCompressedReduceScatter(ProcessGroupDdlcomm& engine,
                                                            CollectiveReduceScatterArgs args,
                                                            std::optional<CollectiveLevel> host,
                                                            std::optional<CollectiveLevel> across,
                                                            std::vector<std::string> identities);

}  // namespace ddlcomm::torch_glue
