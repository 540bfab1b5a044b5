// The compressed all-reduce and reduce-scatter over any c10d backend's collectives, for tensors
// on any device. The reduce-scatter (ddlcomm.fsdp) runs here for every group and device: on a
// ddlcomm group over its own all-to-all and reduce-scatter. The all-reduce runs here where the
// pipelined engine (csrc/collectives/compressed_allreduce.cc) cannot: CUDA tensors (over NCCL,
// gloo or ddlcomm) and groups without CPU collectives. It takes that engine's plan (piecesOf,
// hostPlanOf, encodeStream), so it makes the same bytes and results; only the exchanges differ:
// whole-group all-to-all and all-gather instead of pipelined sends.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <optional>
#include <string>
#include <vector>

#include "compress/compress.h"

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

// Runs the whole call on the caller's thread: kernels and device copies are enqueued on the
// current stream of the tensor's device; a backend whose collectives run on that device (NCCL)
// orders them there, so nothing waits on the host. Every rank ends with the same bits.
void compressedAllreduceOverCollectives(const CollectiveGroup& group, const CollectiveAllreduceArgs& args);

// The compressed reduce-scatter: chunk o of the input, encoded with its worker residual and
// randomness stream encodeStream(stream, rank, 0, o, n, 0), goes to rank o in one all-to-all;
// each rank sums what it receives in float32 in rank order, scales it for an average and
// writes it in the output's dtype. Over two levels, the host's exact reduce-scatter first (of
// the chunks of the ranks at each place on every host, in the tensors' dtype), then the same
// among the ranks at this rank's place, whose residuals hold that host sum's error.
void compressedReduceScatterOverCollectives(const CollectiveGroup& group, const CollectiveReduceScatterArgs& args);

// Payload bytes every rank sends in one flat compressed reduce-scatter of `count` output elements.
size_t compressedReduceScatterWireBytes(const compress::Config& config, size_t count, int size);

}  // namespace ddlcomm::torch_glue
