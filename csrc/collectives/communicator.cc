#include "collectives/communicator.h"

#include <algorithm>
#include <cstdlib>
#include <thread>

namespace ddlcomm {
namespace {

const char* kFailureKey = "ddlcomm/first_failure";
const std::string kWaitingKey = "ddlcomm/failed_while_waiting/";

size_t envSize(const char* name, size_t fallback) {
  const char* v = std::getenv(name);
  if (!v || !*v) return fallback;
  char* end = nullptr;
  unsigned long long parsed = std::strtoull(v, &end, 10);
  DDLCOMM_CHECK(end && *end == '\0', ErrorKind::InvalidArgument, name, "='", v, "' is not a byte count");
  return size_t(parsed);
}

}  // namespace

CollectiveOptions CollectiveOptions::fromEnvironment(std::chrono::milliseconds timeout) {
  CollectiveOptions o;
  o.timeout = timeout;
  o.smallMessageBytes = envSize("DDLCOMM_SMALL_MESSAGE_BYTES", o.smallMessageBytes);
  o.segmentBytes = std::max<size_t>(4096, envSize("DDLCOMM_SEGMENT_BYTES", o.segmentBytes));
  if (const char* algo = std::getenv("DDLCOMM_ALLREDUCE_ALGO")) {
    std::string a = algo;
    if (a == "ring") o.allreduceAlgorithm = AllreduceAlgorithm::Ring;
    else if (a == "rd" || a == "recursive_doubling") o.allreduceAlgorithm = AllreduceAlgorithm::RecursiveDoubling;
    else if (a.empty() || a == "auto") o.allreduceAlgorithm = AllreduceAlgorithm::Auto;
    else fail(ErrorKind::InvalidArgument, "DDLCOMM_ALLREDUCE_ALGO='", a, "': expected auto, ring or recursive_doubling");
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

Communicator::Communicator(std::unique_ptr<Transport> transport, std::shared_ptr<KeyValueStore> store,
                           CollectiveOptions options)
    : transport_(std::move(transport)), store_(std::move(store)), options_(options) {
  transport_->setFailureHook([this](ErrorKind kind, const std::string& message) { return recordFailure(kind, message); });
  transport_->setFailureProbe([this] { return recordedFailure(); });
}

Communicator::~Communicator() {
  transport_->setFailureHook(nullptr);
  transport_->setFailureProbe(nullptr);
}

std::string Communicator::recordedFailure() {
  try {
    if (store_ && store_->check(kFailureKey)) return store_->get(kFailureKey);
  } catch (...) {
    // An unreachable store says nothing about the peers.
  }
  return "";
}

std::string Communicator::ranksNotWaiting() {
  // Ranks waiting in the same collective time out within about the time they entered it
  // apart; a rank still silent after that grace period was never there.
  const auto grace = std::clamp(options_.timeout / 10, std::chrono::milliseconds(1000), std::chrono::milliseconds(5000));
  const Deadline deadline = Clock::now() + grace;
  std::string silent;
  while (true) {
    silent.clear();
    for (int r = 0; r < size(); ++r) {
      if (r != rank() && !store_->check(kWaitingKey + std::to_string(r))) silent += ", rank " + std::to_string(r);
    }
    if (silent.empty() || Clock::now() >= deadline) return silent.empty() ? silent : silent.substr(2);
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

std::string Communicator::recordFailure(ErrorKind kind, const std::string& local) {
  std::string message = local;
  const bool remoteSymptom = kind == ErrorKind::PeerFailure || kind == ErrorKind::Timeout;
  if (remoteSymptom && store_) {
    try {
      // Either way this rank was waiting in a collective when the group failed.
      store_->set(kWaitingKey + std::to_string(rank()), "1");
      const std::string silent = kind == ErrorKind::Timeout ? ranksNotWaiting() : "";
      if (!silent.empty()) {
        message += "; not waiting in any collective when this one timed out (the likely cause): " + silent;
      }
    } catch (...) {
      // The store may be gone; the local message still stands.
    }
  }
  try {
    if (store_ && store_->check(kFailureKey)) {
      std::string first = store_->get(kFailureKey);
      // Lead with the root cause: this rank's own symptom may just be a peer aborting.
      if (remoteSymptom && first != local) message = "the group failed first at " + first + "; then here: " + message;
    } else if (store_) {
      store_->set(kFailureKey, "rank " + std::to_string(rank()) + ": " + local);
    }
  } catch (...) {
    // The store may have died with the failed rank; the local message still stands.
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
