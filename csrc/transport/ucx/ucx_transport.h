// UCX transport (DDLCOMM_TRANSPORT=ucx): one UCP worker with tag matching, one endpoint per
// peer; UCX picks the wire (UCX_TLS: tcp, shared memory, RDMA...). Same semantics as
// tcp/TcpTransport: in-order delivery per pair of ranks, every message framed by FrameHeader
// and checked against what the receiver posted, point-to-point matching by tag.
//
// Tags: [kind:2][source rank:22][low 40 bits]. A collective receive matches the next
// collective message from its peer (mask on kind and source; UCP matches one sender's
// messages in send order) into [FrameHeader | user buffer], and the header is compared
// after completion; large ones are split into a header message and a contiguous payload
// message, received by two receives posted together. A point-to-point receive matches kind, source (unless any-source) and
// the low 40 bits of the user's tag; the header carries the full tag, so two tags equal in
// their low 40 bits yield a Mismatch error, never a silent mix-up.
//
// Unexpected messages are UCX's own: eager ones (small) are buffered by UCX, rendezvous
// ones wait at the sender until a receive matches, so buffering is bounded by UCX's eager
// threshold per message.
//
// Trust: peers' worker addresses come from the store, and each endpoint's first message is
// an HMAC of the group key (transport/handshake.h groupKey, DDLCOMM_AUTH_KEY included) over the
// pair of ranks; connect() returns only once every peer has proved the key, so no
// collective data goes to a worker that cannot.
#pragma once

#include <ucp/api/ucp.h>

#include <chrono>
#include <list>
#include <memory>
#include <string>
#include <vector>

#include "transport/store.h"
#include "transport/transport.h"

namespace ddlcomm::ucx {

class UcxTransport final : public Transport {
 public:
  // Publishes this rank's worker address in `store`, connects to every peer and returns once
  // each has proved the group key. Throws Error(Timeout) if peers do not show up in time.
  static std::unique_ptr<UcxTransport> connect(int rank, int size, KeyValueStore& store,
                                               std::chrono::milliseconds connectTimeout);
  ~UcxTransport() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  void postSend(Request& request) override;
  void postRecv(Request& request) override;
  void wait(Request& request, Deadline deadline) override;
  void poll(std::chrono::milliseconds timeout) override;
  void wakeup() override;
  void abort(ErrorKind kind, const std::string& reason) noexcept override;
  void throwIfBroken() const override;
  // connectionsPerPeer: 1 per peer whose endpoint has not failed. bytesSent: header and
  // payload bytes of the sends this transport completed (UCX has no kernel counters to read).
  TransportStats stats() const override;

 private:
  struct ContextDeleter {
    void operator()(ucp_context_h c) const { ucp_cleanup(c); }
  };
  struct WorkerDeleter {
    void operator()(ucp_worker_h w) const { ucp_worker_destroy(w); }
  };
  using Context = std::unique_ptr<std::remove_pointer_t<ucp_context_h>, ContextDeleter>;
  using Worker = std::unique_ptr<std::remove_pointer_t<ucp_worker_h>, WorkerDeleter>;

  // An endpoint to one peer. Closing needs worker progress, so the transport closes it
  // (close()); the destructor only force-closes one that is somehow still open.
  class Endpoint {
   public:
    Endpoint() = default;
    explicit Endpoint(ucp_ep_h ep) : ep_(ep) {}
    Endpoint(Endpoint&& o) noexcept : ep_(o.ep_) { o.ep_ = nullptr; }
    Endpoint& operator=(Endpoint&& o) noexcept;
    ~Endpoint();
    ucp_ep_h get() const { return ep_; }
    // Starts closing; returns the UCX request to progress, or nullptr when already done.
    void* close(bool force);

   private:
    ucp_ep_h ep_ = nullptr;
  };

  enum class OpKind { Send, CollectiveRecv, PointToPointRecv, AnySourceRecv, Hello };
  // One UCX operation. Lives in active_ (stable addresses: UCX holds a pointer to it as
  // user data, and to its iov) until its callback has run; recycled through free_, so the
  // steady state allocates nothing per message.
  struct Op {
    UcxTransport* owner = nullptr;
    std::list<Op>::iterator self;  // its place in active_
    uint64_t sequence = 0;         // posting order: completions are finished in it
    OpKind kind = OpKind::Send;
    Request* request = nullptr;  // nullptr once the transport has failed it
    int peer = -1;
    FrameHeader header{};  // a send's, or what a receive got
    ucp_dt_iov_t iov[2]{};
    size_t iovCount = 0;     // 1: a contiguous buffer, iov[0]
    bool headerOnly = false;  // a receive of a split message's header (kSplitBytes)
    bool payload = false;     // a receive of a split message's payload
    void* ucx = nullptr;  // the UCX request, freed once completed
    bool completed = false;
    ucs_status_t status = UCS_OK;
    ucp_tag_t senderTag = 0;
    size_t length = 0;  // bytes received
  };
  struct PeerFailureSlot {  // the error handler's argument
    UcxTransport* owner = nullptr;
    int peer = -1;
  };

  UcxTransport(int rank, int size);
  void establish(KeyValueStore& store, std::chrono::milliseconds connectTimeout);
  void checkPeer(int peer, const char* what) const;
  Op& newOp(OpKind kind, Request* request, int peer);
  void submitSend(Op& op, ucp_tag_t tag);
  void submitRecv(Op& op, ucp_tag_t tag, ucp_tag_t mask);
  static void sendDone(void* request, ucs_status_t status, void* user);
  static void recvDone(void* request, ucs_status_t status, const ucp_tag_recv_info_t* info, void* user);
  static void endpointFailed(void* arg, ucp_ep_h ep, ucs_status_t status);

  // Progresses the worker and finishes completed operations; true if anything moved, and
  // *completed set if an operation completed.
  bool progress(bool* completed = nullptr);
  // Marks `op` completed and queues it for progress() to finish.
  void complete(Op& op, ucs_status_t status);
  void finish(Op& op);
  void finishUnguarded(Op& op, Request& r);
  void finishRecv(Op& op, Request& r);
  // Fails pending operations that involve a peer whose endpoint failed.
  void checkFailedPeers();
  [[noreturn]] void peerLost(int peer, const Op* op, ucs_status_t status);
  // For endpoints UCX cannot supervise: fails peers whose process on this host has exited.
  void checkPeerProcesses();
  // Arms the worker's event fd and waits on it; true if an event (or wakeup) came.
  bool waitForEvents(int timeoutMs);
  [[noreturn]] void timedOut(const Request& request);
  void closeEndpoints(bool force) noexcept;

  const int rank_;
  const int size_;
  Context context_;
  Worker worker_;
  int eventFd_ = -1;
  std::vector<Endpoint> endpoints_;  // [peer]; own slot empty
  std::vector<PeerFailureSlot> failureSlots_;
  std::vector<ucs_status_t> peerStatus_;  // UCS_OK, or the error the endpoint reported
  // UCX 1.13's shared memory transports (UCX_TLS=sm) cannot report a peer's failure
  // (UCP_ERR_HANDLING_MODE_PEER makes them unreachable), so those endpoints run without
  // error handling, and a peer process on this host (same boot and pid namespace, published
  // with the address) is watched through /proc instead after each idle second. Without
  // error handling UCX aborts the process when a CMA copy fails, as it does when the peer
  // dies mid-transfer: jobs that must outlive a peer use UCX_TLS=posix,sysv,self (or tcp).
  struct PeerProcess {
    bool watched = false;
    bool exited = false;
    long pid = 0;
    std::string startTime;  // /proc/<pid>/stat field 22: tells a reused pid apart
  };
  std::vector<PeerProcess> processes_;
  std::list<Op> active_;
  std::list<Op> free_;
  // Completed operations not yet finished. A wait polls progress() in a tight loop while
  // hundreds of segments are in flight; scanning active_ there cost more CPU than UCX itself.
  std::vector<Op*> completed_;
  uint64_t nextSequence_ = 0;
  uint64_t bytesSent_ = 0;
  bool broken_ = false;
  ErrorKind brokenKind_ = ErrorKind::Aborted;
  std::string brokenReason_;
};

}  // namespace ddlcomm::ucx
