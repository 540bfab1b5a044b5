#include "torch/backend.h"

#include <ATen/Functions.h>
#include <c10/util/Exception.h>
#include <pybind11/pybind11.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <algorithm>
#include <future>
#include <numeric>
#include <optional>

#include "collectives/collectives.h"
#include "common/env.h"
#include "compress/parallel.h"
#include "transport/connect.h"
#include "torch/process_group_transport.h"
#include "torch/tensor_args.h"

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

// torchrun's agent keeps one rendezvous store for every attempt of a job (elastic restarts):
// what an earlier attempt left there (addresses, shared-memory handles, failure records) must
// not reach this one, so the group's keys live under the attempt's number. With one agent
// that is its restart count (TORCHELASTIC_RESTART_COUNT). Across hosts the agents' counts
// differ (one that restarts its ranks because another host's failed does not count it), so
// there every member counts itself in instead: the members of one attempt all arrive before
// any of the next starts, so arrival n is in attempt (n - 1) / size. A member that dies before
// it arrives leaves its attempt short, and the later attempts then fail to connect.
c10::intrusive_ptr<c10d::Store> attemptStore(const c10::intrusive_ptr<c10d::Store>& store, int size) {
  const char* restarts = envString("TORCHELASTIC_RESTART_COUNT");
  if (!restarts || !*restarts) return store;
  const char* agents = envString("GROUP_WORLD_SIZE");
  std::string attempt = restarts;
  if (!agents || std::string(agents) != "1") {
    attempt = std::to_string((store->add("ddlcomm/arrivals_of_" + std::to_string(size), 1) - 1) / size);
  }
  return c10::make_intrusive<c10d::PrefixStore>("ddlcomm/attempt_" + attempt, store);
}

std::exception_ptr toTorchException(std::exception_ptr error, const std::string& prefix) {
  try {
    std::rethrow_exception(error);
  } catch (const Error& e) {
    std::string message = prefix + e.what();
    try {
      switch (reportedAs(e.kind(), /*inCollective=*/true)) {
        case Reported::Value: TORCH_CHECK_VALUE(false, message);
        case Reported::Type: TORCH_CHECK_TYPE(false, message);
        case Reported::Failure: C10_THROW_ERROR(DistBackendError, message);
      }
    } catch (...) {
      return std::current_exception();
    }
    return error;  // not reached: every case throws
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

DdlcommWork::DdlcommWork(int rank, c10d::OpType type, std::vector<at::Tensor> outputs,
                         std::shared_ptr<const std::string> prefix)
    : Work(rank, type), outputs_(std::move(outputs)), prefix_(std::move(prefix)) {
  auto devices = cudaDevices(outputs_);
  if (!devices.empty()) future_ = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::ofTensors(), devices);
}

void DdlcommWork::settle(c10::ivalue::Future& future) const {
  if (error_) {
    future.setError(error_);
  } else {
    future.markCompleted(c10::IValue(outputs_));
  }
}

c10::intrusive_ptr<c10::ivalue::Future> DdlcommWork::getFuture() {
  std::lock_guard<std::mutex> lock(futureMutex_);
  if (!future_) {
    future_ = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::ofTensors());
    if (completed_) settle(*future_);
  }
  return future_;
}

void DdlcommWork::complete(std::exception_ptr error) {
  if (error) error = toTorchException(error, *prefix_);
  c10::intrusive_ptr<c10::ivalue::Future> future;
  {
    std::lock_guard<std::mutex> lock(futureMutex_);
    completed_ = true;
    error_ = error;
    future = future_;
  }
  if (future) settle(*future);
  finish(error);
}

void ProcessGroupDdlcomm::describeGroup(int rank, int size, std::chrono::milliseconds timeout,
                                        const std::vector<int64_t>& globalRanks, const std::string& groupName) {
  options_->timeout = timeout;
  options_->group_name = groupName;
  options_->global_ranks_in_group.assign(globalRanks.begin(), globalRanks.end());
  prefix_ = c10::str("[ddlcomm rank ", rank, "/", size);
  if (!globalRanks.empty() && size_t(rank) < globalRanks.size() && globalRanks[size_t(rank)] != rank) {
    prefix_ += c10::str(" of group '", groupName, "', global rank ", globalRanks[size_t(rank)]);
  }
  prefix_ += "] ";
  workPrefix_ = std::make_shared<const std::string>(prefix_);
}

ProcessGroupDdlcomm::ProcessGroupDdlcomm(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                         std::chrono::milliseconds timeout, std::vector<int64_t> globalRanks,
                                         std::string groupName, const c10::intrusive_ptr<Options>& options)
    : Backend(rank, size),
      options_(options ? c10::make_intrusive<Options>(*options) : c10::make_intrusive<Options>()),
      store_(attemptStore(store, size)),
      timeoutMs_(timeout.count()) {
  describeGroup(rank, size, timeout, globalRanks, groupName);
  auto kv = std::make_shared<StoreAdapter>(store_);
  try {
    // Every setting is read before connecting: a bad value fails at once, not after the peers joined.
    auto transportOptions = TransportOptions::resolve(options_->transport, timeout);
    auto collectiveOptions = CollectiveOptions::fromEnvironment(timeout, options_->allreduceAlgorithm);
    inlineBytes_ = size_t(envInteger("DDLCOMM_INLINE_BYTES", int64_t(inlineBytes_), 0));
    compress::configuredThreads();  // read again by every compressed call
    Connection connection = connectTransport(rank, size, *kv, transportOptions);
    auto comm = std::make_unique<Communicator>(std::move(connection.transport), std::move(connection.topology), kv,
                                               collectiveOptions);
    executor_ = std::make_unique<Executor>(std::move(comm));
  } catch (const Error& e) {
    if (reportedAs(e.kind(), true) == Reported::Value) TORCH_CHECK_VALUE(false, prefix_, e.what());
    C10_THROW_ERROR(DistBackendError, prefix_ + "could not connect the group: " + e.what());
  }
}

ProcessGroupDdlcomm::ProcessGroupDdlcomm(const c10::intrusive_ptr<c10d::Backend>& carrier,
                                         const c10::intrusive_ptr<c10d::Store>& store,
                                         std::chrono::milliseconds timeout, std::string groupName,
                                         const c10::intrusive_ptr<Options>& options)
    : Backend(carrier->getRank(), carrier->getSize()),
      options_(options ? c10::make_intrusive<Options>(*options) : c10::make_intrusive<Options>()),
      timeoutMs_(timeout.count()) {
  describeGroup(rank_, size_, timeout, {}, groupName);
  overCarrier_ = true;
  prefix_.insert(prefix_.size() - 2, c10::str(" over ", carrier->getBackendName()));
  workPrefix_ = std::make_shared<const std::string>(prefix_);
  TORCH_CHECK_VALUE(store, prefix_, "the group's store is needed to connect its ranks");
  try {
    auto collectiveOptions = CollectiveOptions::fromEnvironment(timeout, options_->allreduceAlgorithm);
    compress::configuredThreads();
    // The group's own store, which its backend trusts with its addresses as well. Under a prefix
    // of its own: the group's backend keeps its keys there too.
    StoreAdapter kv(attemptStore(c10::make_intrusive<c10d::PrefixStore>("ddlcomm/engine", store), size_));
    Connection connection = connectTransport(rank_, size_, kv, TransportOptions::resolve(options_->transport, timeout),
                                             std::make_unique<ProcessGroupTransport>(carrier));
    // No failure records in the store: a failure is the carrier's (or a local peer's exit, which
    // every rank of the host sees) to report.
    auto comm = std::make_unique<Communicator>(std::move(connection.transport), std::move(connection.topology),
                                               nullptr, collectiveOptions);
    executor_ = std::make_unique<Executor>(std::move(comm));
  } catch (const Error& e) {
    if (reportedAs(e.kind(), true) == Reported::Value) TORCH_CHECK_VALUE(false, prefix_, e.what());
    C10_THROW_ERROR(DistBackendError, prefix_ + e.what());
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

template <typename T>
T ProcessGroupDdlcomm::ask(std::function<T(Communicator&)> question) {
  auto answered = std::make_shared<std::promise<T>>();
  auto result = answered->get_future();
  auto taken = std::make_shared<T>();
  executor_->submit([taken, question](Communicator& comm) { *taken = question(comm); },
                    [answered, taken](std::exception_ptr error) {
                      if (error) answered->set_exception(error); else answered->set_value(*taken);
                    });
  try {
    return result.get();
  } catch (const Error& e) {
    C10_THROW_ERROR(DistBackendError, prefix_ + e.what());
  }
}

GroupStats ProcessGroupDdlcomm::stats() {
  return ask<GroupStats>([](Communicator& comm) { return comm.stats(); });
}

namespace {
// Keeps the tensor (and its contiguous staging copy) alive for an in-flight request.
struct PointToPoint {
  at::Tensor user;
  at::Tensor work;  // contiguous: what the request sends or fills
  std::shared_ptr<Request> request = std::make_shared<Request>();

  PointToPoint(at::Tensor userTensor, at::Tensor contiguous, int peer, int tag)
      : user(std::move(userTensor)), work(std::move(contiguous)) {
    Request& r = *request;
    r.peer = peer;
    r.signature.op = OpCode::PointToPoint;
    r.signature.dtype = toDataType(user);
    r.signature.tag = uint64_t(uint32_t(tag));
    r.signature.count = uint64_t(user.numel());
    r.data = static_cast<char*>(work.data_ptr());
    r.bytes = size_t(work.nbytes());
  }
};
}  // namespace

c10::intrusive_ptr<c10d::Work> ProcessGroupDdlcomm::send(std::vector<at::Tensor>& tensors, int dstRank, int tag) {
  TORCH_CHECK(!overCarrier_, prefix_, "send: use the carrier group itself; this backend runs its collectives");
  at::Tensor user = single(tensors, "send");
  TORCH_CHECK_VALUE(dstRank >= 0 && dstRank < size_ && dstRank != rank_, "ddlcomm send: invalid destination rank ",
                    dstRank, " from rank ", rank_, " in a group of ", size_);
  auto p2p = std::make_shared<PointToPoint>(user, user.contiguous(), dstRank, tag);
  auto work = c10::make_intrusive<DdlcommWork>(rank_, c10d::OpType::SEND, tensors, workPrefix_);
  executor_->submitPointToPoint(
      p2p->request, true, [work, p2p](std::exception_ptr error) { work->complete(error); },
      p2p->request->bytes <= inlineBytes_);
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
  TORCH_CHECK(!overCarrier_, prefix_, "recv: use the carrier group itself; this backend runs its collectives");
  at::Tensor user = single(tensors, "recv");
  auto p2p = std::make_shared<PointToPoint>(user, staged(user), srcRank, tag);
  auto work = c10::make_intrusive<DdlcommWork>(rank_, c10d::OpType::RECV, tensors, workPrefix_);
  executor_->submitPointToPoint(
      p2p->request, false,
      [work, p2p](std::exception_ptr error) {
        if (!error) {
          writeBack(p2p->user, p2p->work);
          work->setSourceRank(p2p->request->peer);  // the sender, for a receive from any rank
        }
        work->complete(error);
      },
      p2p->request->bytes <= inlineBytes_);
  trackCoalesced(work);
  return work;
}

int DdlcommWork::sourceRank() const {
  const int rank = sourceRank_.load();
  TORCH_CHECK(rank >= 0, "ddlcomm: the source rank is known once a receive has completed");
  return rank;
}

}  // namespace ddlcomm::torch_glue
