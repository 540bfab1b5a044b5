// Shared-memory transport: messages between ranks of one host go through byte rings in the
// receiver's region (framed by FrameHeader, matched in order like a connection), and the
// regions double as windows that collectives read in place. Everything else (ranks on
// other hosts, point-to-point messages) goes through the network transport underneath,
// which also carries the group's authentication.
//
// Waiting: spin while peers are making progress, then sleep on the futex doorbell in this
// rank's region, which peers bump after writing to it. Liveness of local peers comes from
// pidfds (their exit is seen within kLivenessPeriod), deadlines and the failure probe apply
// as over TCP.
#pragma once

#include <atomic>
#include <chrono>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "transport/shm/region.h"
#include "transport/store.h"
#include "transport/transport.h"

namespace ddlcomm::shm {

struct ShmOptions {
  size_t ringBytes = 1 << 20;    // DDLCOMM_SHM_RING_BYTES: per pair and direction, a power of two
  // DDLCOMM_SHM_WINDOW_BYTES: each of a rank's two windows. Small enough that a fill stays in
  // the caches between being written, reduced and copied out (docs/transports.md).
  size_t windowBytes = 1 << 20;
  bool required = false;  // DDLCOMM_TRANSPORT=shm: every rank must be local, no fallback
  // Layered only where every rank is local: a wait on shared memory polls the network, which
  // must then never be needed (one whose poll does not progress, Transport::pollProgresses).
  bool wholeGroupOnly = false;

  static ShmOptions fromEnvironment();
};

class ShmTransport final : public Transport, private SharedWindows {
 public:
  // Maps the regions of the ranks on this host and returns the layered transport, waiting
  // as `spin` says, or `network` itself when no peer can share memory with this rank (logged).
  static std::unique_ptr<Transport> layer(std::unique_ptr<Transport> network, KeyValueStore& store,
                                          const ShmOptions& options, SpinPolicy spin);
  ~ShmTransport() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  void postSend(Request& request) override;
  void postRecv(Request& request) override;
  void wait(Request& request, Deadline deadline) override;
  void poll(std::chrono::milliseconds timeout) override;
  void wakeup() override;
  void abort(ErrorKind kind, const std::string& reason) noexcept override;
  void throwIfBroken() const override;
  TransportStats stats() const override;
  SharedWindows* sharedWindows() override { return windowed_ ? this : nullptr; }
  // Given to the network too: a wait on a remote peer sleeps in the network's wait, and a
  // network failure must publish before the network closes its sockets.
  void setFailureHook(FailureHook hook) override;
  void setFailureProbe(FailureProbe probe) override;

 private:
  struct Out {
    Request* request;
    FrameHeader header;
    size_t headerDone = 0;
    size_t done = 0;
  };
  struct In {
    Request* request;
    size_t done = 0;
  };
  struct Peer {
    int rank = -1;
    Region region;  // the peer's, mapped here
    ProcessWatch watch;
    RingControl* outControl = nullptr;  // this rank's ring into the peer's region
    char* outData = nullptr;
    RingControl* inControl = nullptr;  // the peer's ring into this rank's region
    char* inData = nullptr;
    std::deque<Out> sends;
    std::deque<In> recvs;
    FrameHeader header{};  // of the incoming message, once headerGot reaches its size
    size_t headerGot = 0;
    bool haveHeader = false;
  };

  ShmTransport(std::unique_ptr<Transport> network, const ShmOptions& options);

  Peer* local(int rank) { return peerIndex_[size_t(rank)] < 0 ? nullptr : &peers_[size_t(peerIndex_[size_t(rank)])]; }
  bool viaNetwork(const Request& r) const {
    return r.signature.op == OpCode::PointToPoint || r.peer < 0 || peerIndex_[size_t(r.peer)] < 0;
  }
  void trackNetwork(Request& r);
  void pruneNetwork();

  bool pumpAll();
  size_t sliceBytes() const;
  bool pumpSend(Peer& p);
  bool pumpRecv(Peer& p);
  bool shmBusy() const;

  // Drives shm and network progress until done(); `waitedPeer`/`signature` name what is
  // waited for in timeout and failure messages.
  template <typename Done>
  void progressUntil(Done&& done, Deadline deadline, int waitedPeer, const Signature& signature);
  template <typename Done>
  void sleep(Deadline deadline, Done& done);
  void checkPeers(int waitedPeer, const Signature& signature);
  [[noreturn]] void timedOut(int waitedPeer, const Signature& signature, const std::string& progress);

  // SharedWindows
  size_t windowBytes() const override { return layout_.windowBytes; }
  int nextHalf() override { return int(fills_++ % 2); }
  char* window(int rank, int half) override;
  void sync(const Signature& signature, uint64_t bytes, Deadline deadline) override;

  std::unique_ptr<Transport> network_;
  const int rank_;
  const int size_;
  ShmOptions options_;
  Layout layout_;
  Region own_;
  std::vector<Peer> peers_;
  std::vector<int> peerIndex_;       // rank -> index in peers_, -1 for the network
  std::vector<Request*> netPending_;  // posted to the network, not seen done yet
  bool windowed_ = false;
  bool mixed_ = false;  // some peers are reached through the network
  bool syncing_ = false;
  // Set by wakeup() (any thread), taken by poll() before it sleeps: a wakeup that comes
  // before poll() marks itself sleeping is not lost (the doorbell is rung only for sleepers).
  std::atomic<bool> wakeRequested_{false};
  uint64_t generation_ = 0;
  uint64_t fills_ = 0;
  uint64_t bytesSent_ = 0;
  bool broken_ = false;
  ErrorKind brokenKind_ = ErrorKind::Aborted;
  std::string brokenReason_;
};

}  // namespace ddlcomm::shm
