// The transport itself: construction, posting sends and receives (to a local peer's ring, or to
// the network underneath), the shared windows, abort and statistics. Set-up is in setup.cc,
// the rings in rings.cc, progress and waiting in progress.cc, the options in options.cc.
#include "transport/shm/shm_transport.h"

#include <algorithm>

namespace ddlcomm::shm {

ShmTransport::ShmTransport(std::unique_ptr<Transport> network, const ShmOptions& options)
    : network_(std::move(network)), rank_(network_->rank()), size_(network_->size()), options_(options) {
  peerIndex_.assign(size_t(size_), -1);
}

ShmTransport::~ShmTransport() { abort(ErrorKind::Aborted, "transport destroyed"); }

void ShmTransport::trackNetwork(Request& r) {
  if (!r.done()) netPending_.push_back(&r);
}

// Requests complete only inside this class's calls into the network, and the caller may
// free them once a call returns: every such call prunes before returning.
void ShmTransport::pruneNetwork() {
  netPending_.erase(std::remove_if(netPending_.begin(), netPending_.end(), [](Request* r) { return r->done(); }),
                    netPending_.end());
}

void ShmTransport::postSend(Request& r) {
  guarded([&] {
    throwIfBroken();
    if (viaNetwork(r)) {
      network_->postSend(r);
      trackNetwork(r);
      pruneNetwork();
      return;
    }
    Peer& p = *local(r.peer);
    DDLCOMM_CHECK(!p.region.header().closed.load(), ErrorKind::PeerFailure, "rank ", rank_, " cannot send ",
                  r.signature.describe(), " to rank ", r.peer, ": it shut its transport down");
    r.transfersLeft = 1;
    r.failed = false;
    p.sends.push_back(Out{&r, makeFrameHeader(r.signature, 0, r.bytes)});
    pumpSend(p);  // eager: usually the ring has room and the message leaves right away
  });
}

void ShmTransport::postRecv(Request& r) {
  guarded([&] {
    throwIfBroken();
    if (viaNetwork(r)) {
      network_->postRecv(r);
      trackNetwork(r);
      pruneNetwork();
      return;
    }
    r.transfersLeft = 1;
    r.failed = false;
    local(r.peer)->recvs.push_back(In{&r});
  });
}

char* ShmTransport::window(int rank, int half) {
  const Region& s = rank == rank_ ? own_ : local(rank)->region;
  return s.base() + layout_.window(half);
}

void ShmTransport::setFailureHook(FailureHook hook) {
  if (network_) network_->setFailureHook(hook);
  Transport::setFailureHook(std::move(hook));
}

void ShmTransport::setFailureProbe(FailureProbe probe) {
  if (network_) network_->setFailureProbe(probe);
  Transport::setFailureProbe(std::move(probe));
}

void ShmTransport::abort(ErrorKind kind, const std::string& reason) noexcept {
  if (broken_) return;
  broken_ = true;
  brokenKind_ = kind;
  // The hook runs once per failure: a network that failed first ran it (it was forwarded
  // there), and its message is kept; otherwise it runs here, and not again in the network.
  bool networkFailed = false;
  try {
    if (network_) network_->throwIfBroken();
  } catch (const Error& e) {
    networkFailed = true;
    brokenKind_ = e.kind();
    brokenReason_ = e.what();
  }
  if (!networkFailed) brokenReason_ = failureMessage(kind, reason);
  for (Peer& p : peers_) {
    for (Out& o : p.sends) o.request->failed = true, o.request->transfersLeft = 0;
    for (In& i : p.recvs) i.request->failed = true, i.request->transfersLeft = 0;
    p.sends.clear();
    p.recvs.clear();
  }
  // Peers waiting on this rank see it gone at their next look, like a closed socket.
  if (own_.valid()) {
    own_.header().closed.store(1);
    for (Peer& p : peers_) ring(p.region.header());
  }
  if (network_) {
    network_->setFailureHook(nullptr);
    network_->abort(kind, brokenReason_);
  }
  netPending_.clear();
}

void ShmTransport::throwIfBroken() const {
  if (broken_) throw Error(brokenKind_, brokenReason_);
}

TransportStats ShmTransport::stats() const {
  TransportStats s = network_->stats();
  s.sharedMemoryPeers = int(peers_.size());
  s.sharedMemoryBytesSent = bytesSent_;
  s.sharedMemorySpinMicros = spin_.duration.count();
  return s;
}

}  // namespace ddlcomm::shm
