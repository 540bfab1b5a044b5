// The torch.distributed backend "ddlcomm": maps c10d calls (tensors, reduce ops, Work
// objects with futures) onto the torch-free collectives. Only csrc/torch/ includes torch.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <ATen/record_function.h>
#include <c10/util/ThreadLocalDebugInfo.h>

#include <atomic>
#include <chrono>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "collectives/executor.h"
#include "compress/compress.h"
#include "torch/device_staging.h"
#include "transport/connect.h"

namespace ddlcomm::torch_glue {

// A Work whose completion comes from the executor thread; its future carries the output
// tensors, which is what DDP chains on.
class DdlcommWork : public c10d::Work {
 public:
  DdlcommWork(int rank, c10d::OpType type, std::vector<at::Tensor> outputs,
              std::shared_ptr<const std::string> prefix);
  std::vector<at::Tensor> result() override { return outputs_; }
  const std::vector<at::Tensor>& outputs() const { return outputs_; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;
  // The sender of a receive from any rank, set before it completes.
  int sourceRank() const override;
  void setSourceRank(int rank) { sourceRank_ = rank; }
  // Marks the future and the Work; translates ddlcomm errors into torch's exception types.
  void complete(std::exception_ptr error);

 private:
  void settle(c10::ivalue::Future& future) const;  // completes `future` as this Work completed

  std::vector<at::Tensor> outputs_;
  std::shared_ptr<const std::string> prefix_;
  std::atomic<int> sourceRank_{-1};
  // Made when first asked for (most Work is only waited on), except for CUDA outputs: their
  // future records its events on the streams current at completion.
  std::mutex futureMutex_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  bool completed_ = false;
  std::exception_ptr error_;
};

// The caller's profiler state, carried to the executor thread so that a collective's span
// ("ddlcomm:all_reduce", with its tensors as inputs) is recorded where the work runs.
struct ProfilerContext {
  ProfilerContext(std::string spanName, std::vector<at::Tensor> tensors);
  std::string name;
  std::vector<c10::IValue> inputs;
  at::RecordFunctionTLS recordFunction;
  std::shared_ptr<c10::ThreadLocalDebugInfo> debugInfo;

  // Installs the context on the current thread, restores the thread's own on exit.
  class Scope {
   public:
    explicit Scope(const ProfilerContext& context);
    ~Scope();
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    at::RecordFunctionTLS saved_;
    c10::DebugInfoGuard debugInfo_;
  };
};

class ProcessGroupDdlcomm : public c10d::Backend {
 public:
  // ProcessGroupDdlcomm.Options, the pg_options of a ddlcomm group, as ProcessGroupNCCL's: c10d's
  // fields plus what this group asks of its transport over the environment.
  struct Options : c10d::Backend::Options {
    explicit Options(std::chrono::milliseconds timeout = kBackendDefaultTimeout)
        : c10d::Backend::Options("ddlcomm", timeout) {}
    TransportRequest transport;
    std::optional<std::string> allreduceAlgorithm;  // unset: DDLCOMM_ALLREDUCE_ALGO, else auto
  };

  // `options` (may be null) is copied: the caller's object stays as it was. `timeout` wins over
  // its timeout, as for NCCL (torch passes the group's timeout= here).
  ProcessGroupDdlcomm(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                      std::chrono::milliseconds timeout, std::vector<int64_t> globalRanks, std::string groupName,
                      const c10::intrusive_ptr<Options>& options = {});
  // A ddlcomm backend over `carrier`'s point-to-point (ProcessGroupTransport): where a group of
  // another backend runs its compressed collectives (ddlcomm.compressed.engine_of). Its ranks
  // connect through the group's `store`, as a ddlcomm group's do (connectTransport's layers,
  // under its options' transport choice): where the group is on one host they exchange through
  // shared memory instead. The options' allreduce_algorithm decides its own collectives'
  // levels over hosts.
  ProcessGroupDdlcomm(const c10::intrusive_ptr<c10d::Backend>& carrier, const c10::intrusive_ptr<c10d::Store>& store,
                      std::chrono::milliseconds timeout, std::string groupName,
                      const c10::intrusive_ptr<Options>& options = {});
  ~ProcessGroupDdlcomm() override;

  const std::string getBackendName() const override { return "ddlcomm"; }
  bool supportsCoalescing() const override { return true; }
  // A copy of the options the group was created with (group name and ranks filled in), with
  // the timeout of the next operations.
  c10::intrusive_ptr<c10d::Backend::Options> getBackendOptions() override;
  // Operations issued after this call use `timeout`.
  void setTimeout(std::chrono::milliseconds timeout) override;
  // Between the two, every operation runs as issued; endCoalescing returns one Work that
  // completes when all of them have (with the first error, if any).
  void startCoalescing() override;
  c10::intrusive_ptr<c10d::Work> endCoalescing() override;
  // gloo's semantics: rank 0 waits for every rank within the timeout and raises naming the
  // first rank that did not arrive (every such rank with waitAllRanks); the others wait for
  // rank 0's release.
  void monitoredBarrier(const c10d::BarrierOptions& opts, bool waitAllRanks = false) override;

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override;
  // dist.all_reduce(tensor, op) without c10d's dispatch and Python layers: the same checks
  // and operation, in the group's order, returning when it is done (ddlcomm.all_reduce_;
  // call without the GIL).
  void allreduceNow(at::Tensor tensor, const c10d::ReduceOp& op);
  c10::intrusive_ptr<c10d::Work> allreduce_sparse(std::vector<at::Tensor>& tensors,
                                                  const c10d::AllreduceOptions& opts) override {
    return allreduce(tensors, opts);
  }
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                     const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                     std::vector<at::Tensor>& inputs,
                                                     const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs, const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                         std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& outputSplitSizes,
                                               std::vector<int64_t>& inputSplitSizes,
                                               const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dstRank, int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int srcRank, int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;

  void setSequenceNumberForGroup() override {}
  uint64_t getSequenceNumberForGroup() override { return opsIssued_.load(); }
  void abort() override;
  void shutdown() override;

  // Runs `task` on the executor with `outputs` as the Work's result (used by the ops above
  // and by the compressed collectives, collective_compressed.h). `callerWaits` (the op's asyncOp is false: the caller
  // waits at once) lets a small op on an idle group run on the calling thread instead.
  c10::intrusive_ptr<DdlcommWork> enqueue(c10d::OpType type, bool callerWaits, std::vector<at::Tensor> outputs,
                                          std::function<void(Communicator&)> task);
  // An operation on CUDA tensors: `issue` issues it on the host mirrors in `staging` (made
  // by the caller), between the wait for their copies and the copy back of the outputs.
  c10::intrusive_ptr<c10d::Work> throughHost(c10d::OpType type, std::shared_ptr<DeviceStaging> staging,
                                             const std::function<c10::intrusive_ptr<c10d::Work>()>& issue);
  c10::intrusive_ptr<DdlcommWork> enqueue(c10d::OpType type, std::vector<at::Tensor> outputs,
                                          std::function<void(Communicator&)> task) {
    return enqueue(type, false, std::move(outputs), std::move(task));
  }
  std::string describe() const { return prefix_; }
  // The group's counters and its connections as the kernel sees them, taken on the progress
  // thread after everything submitted before (call without the GIL).
  GroupStats stats();

 private:
  // `question`'s answer, taken on the executor after everything submitted before.
  template <typename T>
  T ask(std::function<T(Communicator&)> question);
  // A receive from srcRank, or from any rank (kAnySource).
  c10::intrusive_ptr<c10d::Work> postRecv(std::vector<at::Tensor>& tensors, int srcRank, int tag);
  // allreduce() of a sparse COO tensor (SUM only).
  c10::intrusive_ptr<c10d::Work> allreduceSparse(at::Tensor& tensor, const c10d::AllreduceOptions& opts);
  // Adds `work` to the coalesced Work while coalescing.
  void trackCoalesced(const c10::intrusive_ptr<c10d::Work>& work);
  // What both constructors set before the group's transport exists: the options, the prefix.
  void describeGroup(int rank, int size, std::chrono::milliseconds timeout, const std::vector<int64_t>& globalRanks,
                     const std::string& groupName);

  std::unique_ptr<Executor> executor_;
  c10::intrusive_ptr<Options> options_;  // as created, never changed: the timeout is timeoutMs_
  c10::intrusive_ptr<c10d::Store> store_;  // monitoredBarrier's rendezvous
  std::atomic<int64_t> timeoutMs_;
  uint64_t monitoredBarriers_ = 0;  // calls so far: the key of the next one
  std::mutex coalescingMutex_;
  bool coalescing_ = false;
  std::vector<c10::intrusive_ptr<c10d::Work>> coalesced_;
  std::string prefix_;  // "[ddlcomm rank 1/4] " for every message
  std::shared_ptr<const std::string> workPrefix_;  // the same, shared by every Work
  std::atomic<uint64_t> opsIssued_{0};
  bool overCarrier_ = false;  // messages travel as another backend's send and recv
  // DDLCOMM_INLINE_BYTES: larger operations always go to the progress thread. No limit by
  // default: the caller waits either way, and the hand-off costs two wake-ups at any size.
  size_t inlineBytes_ = std::numeric_limits<size_t>::max();
};

}  // namespace ddlcomm::torch_glue
