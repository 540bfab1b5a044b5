// How the backend runs operations (the executor, profiler spans) and its group-level
// controls: timeout, options, coalescing and the monitored barrier. The collectives
// themselves are in backend_collectives.cc (backend_sparse.cc for sparse tensors).
#include <ATen/record_function.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <chrono>

#include "torch/backend.h"

namespace ddlcomm::torch_glue {
namespace {

// torch's names of the collectives, as gloo's profiler spans use them ("gloo:all_reduce").
const char* profilingName(c10d::OpType type) {
  switch (type) {
    case c10d::OpType::BROADCAST: return "broadcast";
    case c10d::OpType::ALLREDUCE: return "all_reduce";
    case c10d::OpType::ALLREDUCE_COALESCED: return "all_reduce_coalesced";
    case c10d::OpType::REDUCE: return "reduce";
    case c10d::OpType::ALLGATHER: return "all_gather";
    case c10d::OpType::_ALLGATHER_BASE: return "all_gather_into_tensor";
    case c10d::OpType::ALLGATHER_COALESCED: return "all_gather_coalesced";
    case c10d::OpType::GATHER: return "gather";
    case c10d::OpType::SCATTER: return "scatter";
    case c10d::OpType::REDUCE_SCATTER: return "reduce_scatter";
    case c10d::OpType::_REDUCE_SCATTER_BASE: return "reduce_scatter_tensor";
    case c10d::OpType::ALLTOALL_BASE: return "all_to_all_single";
    case c10d::OpType::ALLTOALL: return "all_to_all";
    case c10d::OpType::BARRIER: return "barrier";
    case c10d::OpType::COALESCED: return "coalesced";
    default: return "op";
  }
}

}  // namespace

ProfilerContext::ProfilerContext(std::string spanName, std::vector<at::Tensor> tensors)
    : name(std::move(spanName)),
      recordFunction(at::get_record_function_tls_()),
      debugInfo(c10::ThreadLocalDebugInfo::current()) {
  for (auto& t : tensors) inputs.emplace_back(std::move(t));
}

ProfilerContext::Scope::Scope(const ProfilerContext& context)
    : saved_(at::get_record_function_tls_()), debugInfo_(context.debugInfo) {
  at::set_record_function_tls_(context.recordFunction);
}

ProfilerContext::Scope::~Scope() { at::set_record_function_tls_(saved_); }

c10::intrusive_ptr<DdlcommWork> ProcessGroupDdlcomm::enqueue(c10d::OpType type, bool callerWaits,
                                                             std::vector<at::Tensor> outputs,
                                                             std::function<void(Communicator&)> task) {
  auto work = c10::make_intrusive<DdlcommWork>(rank_, type, outputs, workPrefix_);
  ++opsIssued_;
  // The profiler span "ddlcomm:<op>" is recorded on the executor thread, which does the work,
  // under the caller's profiler state (thread-local in torch.profiler).
  // A collective writes into the caller's tensors (a broadcast of a model's parameters among
  // them: leaves that require grad); autograd records none of it, on whichever thread runs it.
  std::function<void(Communicator&)> run;
  if (at::hasCallbacks()) {
    run = [task = std::move(task), profiler = ProfilerContext(c10::str("ddlcomm:", profilingName(type)),
                                                                std::move(outputs))](Communicator& comm) {
      at::NoGradGuard noGrad;
      ProfilerContext::Scope scope(profiler);
      RECORD_FUNCTION(profiler.name, profiler.inputs);
      task(comm);
    };
  } else {
    run = [task = std::move(task)](Communicator& comm) {
      at::NoGradGuard noGrad;
      task(comm);
    };
  }
  Executor::Done done = [work](std::exception_ptr error) { work->complete(error); };
  size_t bytes = 0;
  for (const auto& t : work->outputs()) bytes += t.defined() ? size_t(t.numel()) * t.element_size() : 0;
  // An operation that the caller waits for anyway runs on this thread when the group is idle:
  // the hand-off to the progress thread and back costs two wake-ups (on shared memory, 256 KiB
  // ran at half the speed through it).
  // Asynchronous ones never do, so they return before their peers arrive.
  if (!callerWaits || bytes > inlineBytes_ || !executor_->runInlineIfIdle(run, done)) executor_->submit(std::move(run), std::move(done));
  trackCoalesced(work);
  return work;
}


c10::intrusive_ptr<c10d::Work> ProcessGroupDdlcomm::throughHost(
    c10d::OpType type, std::shared_ptr<DeviceStaging> staging,
    const std::function<c10::intrusive_ptr<c10d::Work>()>& issue) {
  staging->recordCopies();
  // The executor runs tasks in order: the wait, the operation on the mirrors, the copy back.
  // A failed wait (a broken CUDA context) fails the operation, through the copy back's wait.
  auto waited = std::make_shared<std::exception_ptr>();
  executor_->submit([staging](Communicator&) { staging->waitForCopies(); },
                    [waited](std::exception_ptr error) { *waited = error; });
  c10::intrusive_ptr<c10d::Work> onHost = issue();
  return enqueue(type, staging->userOutputs(), [staging, onHost, waited](Communicator&) {
    if (*waited) std::rethrow_exception(*waited);
    onHost->wait();  // done already (it ran before this task); raises its failure
    staging->copyBack();
  });
}

c10::intrusive_ptr<c10d::Backend::Options> ProcessGroupDdlcomm::getBackendOptions() {
  // A copy: the caller may change it (split_group deep-copies it for the child), the group not.
  auto copy = c10::make_intrusive<Options>(*options_);
  copy->timeout = std::chrono::milliseconds(timeoutMs_.load());
  return copy;
}

void ProcessGroupDdlcomm::setTimeout(std::chrono::milliseconds timeout) {
  TORCH_CHECK_VALUE(timeout.count() > 0, "ddlcomm setTimeout: the timeout must be positive, got ", timeout.count(),
                    " ms");
  timeoutMs_ = timeout.count();
  // In submission order: what was issued before keeps its deadline, what follows gets the new one.
  executor_->submit([timeout](Communicator& comm) { comm.setTimeout(timeout); }, [](std::exception_ptr) {});
}

void ProcessGroupDdlcomm::startCoalescing() {
  std::lock_guard<std::mutex> lock(coalescingMutex_);
  TORCH_CHECK(!coalescing_, prefix_, "startCoalescing called twice without endCoalescing");
  coalescing_ = true;
  coalesced_.clear();
}

void ProcessGroupDdlcomm::trackCoalesced(const c10::intrusive_ptr<c10d::Work>& work) {
  std::lock_guard<std::mutex> lock(coalescingMutex_);
  if (coalescing_) coalesced_.push_back(work);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupDdlcomm::endCoalescing() {
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  {
    std::lock_guard<std::mutex> lock(coalescingMutex_);
    TORCH_CHECK(coalescing_, prefix_, "endCoalescing called without startCoalescing");
    coalescing_ = false;
    works.swap(coalesced_);
  }
  std::vector<at::Tensor> outputs;
  for (const auto& w : works) {
    auto r = w->result();
    outputs.insert(outputs.end(), r.begin(), r.end());
  }
  auto all = c10::make_intrusive<DdlcommWork>(rank_, c10d::OpType::COALESCED, std::move(outputs), workPrefix_);
  if (works.empty()) {
    all->complete(nullptr);
    return all;
  }
  // Completes after the last of them, with the first error seen.
  struct State {
    std::mutex mutex;
    size_t left;
    std::exception_ptr error;
  };
  auto state = std::make_shared<State>();
  state->left = works.size();
  for (const auto& w : works) {
    w->getFuture()->addCallback([state, all](c10::ivalue::Future& f) {
      bool last;
      std::exception_ptr error;
      {
        std::lock_guard<std::mutex> lock(state->mutex);
        if (f.hasError() && !state->error) state->error = f.exception_ptr();
        last = --state->left == 0;
        error = state->error;
      }
      if (last) all->complete(error);
    });
  }
  return all;
}

void ProcessGroupDdlcomm::monitoredBarrier(const c10d::BarrierOptions& opts, bool waitAllRanks) {
  using Clock = std::chrono::steady_clock;
  const auto timeout =
      opts.timeout == c10d::kUnsetTimeout ? std::chrono::milliseconds(timeoutMs_.load()) : opts.timeout;
  TORCH_CHECK(store_, prefix_, "monitored_barrier needs a store: call it on the carrier group");
  // Every rank calls it in the same order, so the count names the same call everywhere.
  const std::string base = c10::str("ddlcomm/monitored_barrier/", monitoredBarriers_++, "/");
  if (rank_ != 0) {
    store_->set(base + std::to_string(rank_), std::vector<uint8_t>{1});
    try {
      store_->wait({base + "released"}, timeout);
    } catch (const c10::DistError& e) {
      C10_THROW_ERROR(DistBackendError, c10::str(prefix_, "monitored barrier: rank 0 did not release rank ", rank_,
                                                 " within ", timeout.count(), " ms: ", e.what_without_backtrace()));
    }
    return;
  }
  const auto deadline = Clock::now() + timeout;
  std::vector<int> missing;
  for (int r = 1; r < size_; ++r) {
    const std::string key = base + std::to_string(r);
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    bool arrived;
    if (left.count() > 0) {
      try {
        store_->wait({key}, left);
        arrived = true;
      } catch (const c10::DistError&) {
        arrived = false;
      }
    } else {
      arrived = store_->check({key});
    }
    if (arrived) continue;
    // gloo's messages, so that code matching them works on either backend.
    TORCH_CHECK(waitAllRanks, prefix_, "Rank ", r, " failed to pass monitoredBarrier in ", timeout.count(), " ms");
    missing.push_back(r);
  }
  if (!missing.empty()) {
    std::string ranks;
    for (size_t i = 0; i < missing.size(); ++i) ranks += (i ? ", " : "") + std::to_string(missing[i]);
    TORCH_CHECK(false, prefix_, "Ranks ", ranks, " failed to pass monitoredBarrier in ", timeout.count(), " ms");
  }
  store_->set(base + "released", std::vector<uint8_t>{1});
}

}  // namespace ddlcomm::torch_glue
