#include "collectives/communicator.h"

#include "common/env.h"

namespace ddlcomm {

AllreduceAlgorithm allreduceAlgorithmNamed(const std::string& name, const std::string& what) {
  if (name == "auto") return AllreduceAlgorithm::Auto;
  if (name == "ring") return AllreduceAlgorithm::Ring;
  if (name == "rd" || name == "recursive_doubling") return AllreduceAlgorithm::RecursiveDoubling;
  if (name == "halving_doubling") return AllreduceAlgorithm::HalvingDoubling;
  if (name == "hierarchical") return AllreduceAlgorithm::Hierarchical;
  fail(ErrorKind::InvalidArgument, what, "='", name,
       "' is invalid: expected auto, ring, recursive_doubling, halving_doubling or hierarchical");
}

CollectiveOptions CollectiveOptions::fromEnvironment(std::chrono::milliseconds timeout,
                                                     const std::optional<std::string>& algorithm) {
  CollectiveOptions o;
  o.timeout = timeout;
  o.smallMessageBytes = size_t(envInteger("DDLCOMM_SMALL_MESSAGE_BYTES", int64_t(o.smallMessageBytes), 0));
  o.halvingDoublingBytes =
      size_t(envInteger("DDLCOMM_HALVING_DOUBLING_BYTES", int64_t(o.halvingDoublingBytes), 0));
  // Below 4 KiB per-message overhead dominates; above 1 GiB nothing is pipelined any more, and
  // the bound keeps the segment arithmetic (bytes + segment - 1) far from overflow.
  o.segmentBytes = size_t(envInteger("DDLCOMM_SEGMENT_BYTES", int64_t(o.segmentBytes), 4096, int64_t(1) << 30));
  o.sharedOneShotBytes = size_t(envInteger("DDLCOMM_SHM_ONESHOT_BYTES", int64_t(o.sharedOneShotBytes), 0));
  if (const char* algo = envString("DDLCOMM_ALLREDUCE_ALGO")) {
    o.allreduceAlgorithm = allreduceAlgorithmNamed(algo, "environment variable DDLCOMM_ALLREDUCE_ALGO");
  }
  if (algorithm) o.allreduceAlgorithm = allreduceAlgorithmNamed(*algorithm, "ddlcomm.Options.allreduce_algorithm");
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
  base_.tag = comm.nextSequenceNumber();
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

Communicator::Communicator(std::unique_ptr<Transport> transport, Topology topology,
                           std::shared_ptr<KeyValueStore> store, CollectiveOptions options)
    : transport_(std::move(transport)),
      topology_(std::move(topology)),
      options_(options),
      failures_(std::move(store), transport_->rank(), transport_->size()) {
  // Every rank read the same records, so every rank refuses alike.
  DDLCOMM_CHECK(options_.allreduceAlgorithm != AllreduceAlgorithm::Hierarchical || topology_.uniform(),
                ErrorKind::InvalidArgument,
                "the hierarchical all-reduce (DDLCOMM_ALLREDUCE_ALGO or ddlcomm.Options.allreduce_algorithm) needs "
                "the same number of ranks on every host; this group has ", topology_.describe());
  transport_->setFailureHook(
      [this](ErrorKind kind, const std::string& message) {
        return failures_.record(kind, message, options_.timeout, nextSeq_.load());
      });
  transport_->setFailureProbe([this] { return failures_.probe(nextSeq_.load()); });
}

Communicator::~Communicator() {
  transport_->setFailureHook(nullptr);
  transport_->setFailureProbe(nullptr);
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
