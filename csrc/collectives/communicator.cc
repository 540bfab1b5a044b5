#include "collectives/communicator.h"

#include <algorithm>
#include <thread>

#include "common/env.h"

namespace ddlcomm {
namespace {

const char* kFailureKey = "ddlcomm/first_failure";
// A plain array, not a std::string: tasks on a detached courier thread may use it at exit.
constexpr char kWaitingKey[] = "ddlcomm/failed_while_waiting/";
// A healthy store answers in milliseconds; one that takes this long is treated as gone.
constexpr std::chrono::milliseconds kStoreCallBound{2000};

}  // namespace

CollectiveOptions CollectiveOptions::fromEnvironment(std::chrono::milliseconds timeout) {
  CollectiveOptions o;
  o.timeout = timeout;
  o.smallMessageBytes = size_t(envInteger("DDLCOMM_SMALL_MESSAGE_BYTES", int64_t(o.smallMessageBytes), 0));
  // Below 4 KiB per-message overhead dominates; above 1 GiB nothing is pipelined any more, and
  // the bound keeps the segment arithmetic (bytes + segment - 1) far from overflow.
  o.segmentBytes = size_t(envInteger("DDLCOMM_SEGMENT_BYTES", int64_t(o.segmentBytes), 4096, int64_t(1) << 30));
  o.sharedOneShotBytes = size_t(envInteger("DDLCOMM_SHM_ONESHOT_BYTES", int64_t(o.sharedOneShotBytes), 0));
  if (const char* algo = envString("DDLCOMM_ALLREDUCE_ALGO")) {
    const std::string a = algo;
    if (a == "ring") o.allreduceAlgorithm = AllreduceAlgorithm::Ring;
    else if (a == "rd" || a == "recursive_doubling") o.allreduceAlgorithm = AllreduceAlgorithm::RecursiveDoubling;
    else if (a == "auto") o.allreduceAlgorithm = AllreduceAlgorithm::Auto;
    else fail(ErrorKind::InvalidArgument, "environment variable DDLCOMM_ALLREDUCE_ALGO='", a,
              "' is invalid: expected auto, ring or recursive_doubling");
  }
  return o;
}

Call::Call(Communicator& comm, OpCode op, DataType dtype, uint64_t count)
    : comm_(comm),
      deadline_(Clock::now() + comm.options().timeout),
      sent_(size_t(comm.size()), 0),
      received_(size_t(comm.size()), 0) {
  base_.op = op;
  base_.dtype = dtype;
  base_.count = count;
  base_.seq = comm.nextSequenceNumber();
}

void Call::send(Request& r, int peer, const void* data, size_t bytes) {
  r.peer = peer;
  r.signature = base_;
  r.signature.step = sent_[size_t(peer)]++;
  r.data = const_cast<char*>(static_cast<const char*>(data));
  r.bytes = bytes;
  comm_.transport().postSend(r);
}

void Call::recv(Request& r, int peer, void* data, size_t bytes) {
  r.peer = peer;
  r.signature = base_;
  r.signature.step = received_[size_t(peer)]++;
  r.data = static_cast<char*>(data);
  r.bytes = bytes;
  comm_.transport().postRecv(r);
}

void Call::wait(Request& r) { comm_.transport().wait(r, deadline_); }

PeerExchange& Call::exchange() { return exchanges_.emplace_back(*this); }

PeerExchange::PeerExchange(Call& call)
    : call_(call), sends_(size_t(call.comm().size())), recvs_(size_t(call.comm().size())) {}

void PeerExchange::send(int to, const void* data, size_t bytes) { call_.send(sends_.at(size_t(to)), to, data, bytes); }

void PeerExchange::recv(int from, void* data, size_t bytes) { call_.recv(recvs_.at(size_t(from)), from, data, bytes); }

void PeerExchange::waitRecv(int from) {
  Request& r = recvs_.at(size_t(from));
  if (r.peer >= 0) call_.wait(r);
}

void PeerExchange::waitSends() {
  for (Request& r : sends_) {
    if (r.peer >= 0) call_.wait(r);
  }
}

Communicator::Communicator(std::unique_ptr<Transport> transport, std::shared_ptr<KeyValueStore> store,
                           CollectiveOptions options)
    : transport_(std::move(transport)), store_(std::move(store)), options_(options), courier_(store_) {
  transport_->setFailureHook([this](ErrorKind kind, const std::string& message) { return recordFailure(kind, message); });
  transport_->setFailureProbe([this] { return failureRecorded(); });
}

Communicator::~Communicator() {
  transport_->setFailureHook(nullptr);
  transport_->setFailureProbe(nullptr);
}

bool Communicator::failureRecorded() {
  auto found = courier_.call([](KeyValueStore& s) { return std::string(s.check(kFailureKey) ? "1" : ""); },
                             kStoreCallBound);
  return found && !found->empty();
}

std::string Communicator::ranksNotWaiting() {
  // Ranks waiting in the same collective time out within about the time they entered it
  // apart; a rank still silent after that grace period was never there.
  const auto grace = std::clamp(options_.timeout / 10, std::chrono::milliseconds(1000), std::chrono::milliseconds(5000));
  const Deadline deadline = Clock::now() + grace;
  std::vector<int> silent;  // ranks with no report yet; each sweep asks only about these
  for (int r = 0; r < size(); ++r) {
    if (r != rank()) silent.push_back(r);
  }
  while (!silent.empty() && Clock::now() < deadline) {
    auto reported = courier_.call(
        [silent](KeyValueStore& s) {
          std::string flags;  // '1' for each rank of `silent` that has reported
          for (int r : silent) flags += s.check(kWaitingKey + std::to_string(r)) ? '1' : '0';
          return flags;
        },
        kStoreCallBound);
    if (!reported) return "";  // the store is unreachable: no way to tell
    std::vector<int> still;
    for (size_t i = 0; i < silent.size(); ++i) {
      if ((*reported)[i] == '0') still.push_back(silent[i]);
    }
    silent.swap(still);
    if (!silent.empty()) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  std::string list;
  for (int r : silent) list += (list.empty() ? "rank " : ", rank ") + std::to_string(r);
  return list;
}

std::string Communicator::recordFailure(ErrorKind kind, const std::string& local) {
  if (!store_) return local;
  std::string message = local;
  const bool remoteSymptom = kind == ErrorKind::PeerFailure || kind == ErrorKind::Timeout;
  const std::string me = std::to_string(rank());
  if (remoteSymptom) {
    // Either way this rank was waiting in a collective when the group failed.
    courier_.call([me](KeyValueStore& s) { s.set(kWaitingKey + me, "1"); return std::string(); }, kStoreCallBound);
    const std::string silent = kind == ErrorKind::Timeout ? ranksNotWaiting() : "";
    // Lead with the cause: whoever this rank waited for may itself have been waiting.
    if (!silent.empty()) {
      message = "likely cause: " + silent + (silent.find(',') == std::string::npos ? " was" : " were") +
                " not waiting in any collective when this one timed out; " + message;
    }
  }
  // Publish this failure unless a peer's came first; either way learn the first one.
  const std::string mine = "rank " + me + ": " + message;
  auto first = courier_.call(
      [mine](KeyValueStore& s) {
        if (s.check(kFailureKey)) return s.get(kFailureKey);
        s.set(kFailureKey, mine);
        return mine;
      },
      kStoreCallBound);
  if (!first) {
    message += " (the store did not answer, so other ranks' reports are unknown)";
  } else if (remoteSymptom && *first != mine) {
    // Lead with the root cause: this rank's own symptom may just be a peer aborting.
    message = "the group failed first at " + *first + "; then here: " + message;
  }
  return message;
}

void Communicator::failed(const Error& error) {
  transport_->abort(error.kind(), error.what());  // no-op if the transport failed first
  transport_->throwIfBroken();
  throw error;
}

void Communicator::throwIfAborted() const {
  try {
    transport_->throwIfBroken();
  } catch (const Error& e) {
    throw Error(ErrorKind::Aborted,
                std::string("this process group failed earlier and cannot be used any more: ") + e.what());
  }
}

char* Communicator::scratch(size_t bytes, int slot) {
  if (scratch_.size() <= size_t(slot)) scratch_.resize(size_t(slot) + 1);
  auto& buffer = scratch_[size_t(slot)];
  if (buffer.size() < bytes) buffer.resize(bytes);
  return buffer.data();
}

}  // namespace ddlcomm
