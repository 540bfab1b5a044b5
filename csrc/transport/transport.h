// The one transport interface: tagged messages between ranks, progressed by whichever
// thread waits. Implementations: tcp/ (sockets + epoll), ucx/ (UCP tag matching, for RDMA
// NICs), and shm/ (shared memory between the ranks of one host, layered over one of those).
//
// Threading: a Transport is driven by one thread (the backend's executor). Only wakeup()
// may be called from other threads.
#pragma once

#include <chrono>
#include <cstddef>
#include <exception>
#include <functional>
#include <string>
#include <vector>

#include "common/error.h"
#include "transport/frame.h"

namespace ddlcomm {

using Clock = std::chrono::steady_clock;
using Deadline = Clock::time_point;

// One posted send or receive. The caller owns it and the buffer it points to, and keeps
// both alive until done() (or until the transport has failed it). Plain data on purpose:
// collectives keep these on the stack or in small arrays, so nothing is allocated per message.
// A point-to-point receive from whichever rank sends first with its tag; the transport then
// sets the request's peer to that rank.
constexpr int kAnySource = -1;

struct Request {
  int peer = -1;  // kAnySource for a point-to-point receive from any rank
  Signature signature;
  char* data = nullptr;
  size_t bytes = 0;

  // Filled in by the transport: the messages of this request still in flight (its stripes
  // over TCP, header and payload over UCX, one over shared memory).
  int transfersLeft = 0;
  bool failed = false;
  bool done() const { return transfersLeft == 0; }
};

// How a rank waiting for a message polls before it sleeps (connectTransport chooses).
struct SpinPolicy {
  std::chrono::microseconds duration{0};
  // Ranks outnumber cores: give the core away between polls, or the peer being waited for
  // may not get to run.
  bool yield = false;
};

// What a transport says about its connections (tests and diagnostics).
struct TransportStats {
  std::string network;  // the network transport's name: "tcp" or "ucx"
  std::vector<int> connectionsPerPeer;  // established connections to each rank (0 for itself)
  // What the network transport sent: TCP, TCP_INFO tcpi_bytes_sent summed over its open sockets
  // (retransmissions too); UCX, header and payload bytes of completed sends.
  uint64_t bytesSent = 0;
  // Of those, retransmitted (TCP_INFO tcpi_bytes_retrans; 0 for UCX).
  uint64_t bytesRetransmitted = 0;
  int sharedMemoryPeers = 0;           // ranks reached through shared memory
  uint64_t sharedMemoryBytesSent = 0;  // message bytes (headers included) written to their rings
  // How long a wait polls before sleeping, in the network transport and in shared memory.
  int64_t spinMicros = 0;
  int64_t sharedMemorySpinMicros = 0;
};

// Memory that every rank of the group maps: offered by the shared-memory transport when all
// ranks share one host, so that collectives can read peers' buffers in place instead of
// exchanging messages. Used by the executor thread only, like the transport.
class SharedWindows {
 public:
  virtual ~SharedWindows() = default;
  virtual size_t windowBytes() const = 0;
  // Which of the two windows of every rank the next fill uses. Every rank fills in the same
  // order and a window is refilled only after the fill in between was synchronised, so a
  // peer never reads a window that is being overwritten.
  virtual int nextHalf() = 0;
  virtual char* window(int rank, int half) = 0;
  // Returns once every rank has reached the same point of the same call: all windows filled
  // before it are readable. Throws Mismatch if a rank is in another call or passed other
  // sizes, Timeout or PeerFailure like a receive.
  virtual void sync(const Signature& signature, uint64_t bytes, Deadline deadline) = 0;
};

class Transport {
 public:
  virtual ~Transport() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;

  // Queue a message. Messages between a pair of ranks are delivered in posting order.
  virtual void postSend(Request& request) = 0;
  // Expect a message. Collective receives match the next collective message from `peer`
  // and must carry an identical signature; point-to-point receives match by tag.
  virtual void postRecv(Request& request) = 0;

  // Drives progress until `request` is done. Throws Error on timeout, on a peer failure or
  // on a signature mismatch; the transport is then broken and every request fails.
  virtual void wait(Request& request, Deadline deadline) = 0;
  // One round of progress; blocks up to `timeout` when nothing can move, or until wakeup().
  virtual void poll(std::chrono::milliseconds timeout) = 0;
  // Thread-safe: interrupts a blocked poll().
  virtual void wakeup() = 0;

  // Fails every request and closes every connection. Idempotent.
  virtual void abort(ErrorKind kind, const std::string& reason) noexcept = 0;
  // Throws the abort reason if the transport is broken.
  virtual void throwIfBroken() const = 0;
  // Counted now, from the kernel's view of each connection.
  virtual TransportStats stats() const = 0;
  // Null unless every rank of the group can read every other's memory.
  virtual SharedWindows* sharedWindows() { return nullptr; }
  // Whether poll() moves and completes requests. False for one whose requests move only while
  // waited for (another backend's send and recv): nothing may then be layered over it that
  // polls it while waiting on something else.
  virtual bool pollProgresses() const { return true; }
  // How a wait polls before it sleeps; connectTransport sets it once connected.
  virtual void setSpin(SpinPolicy spin) { spin_ = spin; }

  // Called once, on the first failure, before any connection is closed: peers notice the
  // closed connections, so whatever the hook publishes is there when they look. Returns
  // the message to fail with.
  using FailureHook = std::function<std::string(ErrorKind, const std::string&)>;
  virtual void setFailureHook(FailureHook hook) { failureHook_ = std::move(hook); }

  // Called by wait() after each second without progress: whether another rank has recorded
  // a failure. A rank whose own sockets show nothing wrong (its connections were lost
  // silently, or its peers failed elsewhere) then fails promptly instead of at its timeout;
  // the failure hook names the recorded failure.
  using FailureProbe = std::function<bool()>;
  virtual void setFailureProbe(FailureProbe probe) { failureProbe_ = std::move(probe); }

 protected:
  // Runs `body`; an Error aborts the transport before it propagates: callers unwind their
  // stacks, and with them the Requests the transport still points to.
  template <typename Body>
  void guarded(Body&& body) {
    try {
      body();
    } catch (const Error& e) {
      abort(e.kind(), e.what());
      throwIfBroken();
      throw;
    }
  }

  // What a transport that fails with `reason` reports: the failure hook's message, called here
  // once per transport from abort(), or `reason` itself for a deliberate shutdown (Aborted),
  // without a hook, or if the hook throws (it is best effort).
  std::string failureMessage(ErrorKind kind, const std::string& reason) noexcept {
    if (!failureHook_ || kind == ErrorKind::Aborted) return reason;
    try {
      return failureHook_(kind, reason);
    } catch (...) {
      return reason;
    }
  }

  FailureHook failureHook_;
  FailureProbe failureProbe_;
  SpinPolicy spin_;
};

}  // namespace ddlcomm
