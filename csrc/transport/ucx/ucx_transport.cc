#include "transport/ucx/ucx_transport.h"

#include <poll.h>
#include <sched.h>

#include <algorithm>
#include <cstring>

#include "transport/ucx/ucx_internal.h"

namespace ddlcomm::ucx {
using namespace internal;
namespace {

std::string humanBytes(size_t bytes) { return detail::concat(bytes, " bytes"); }

}  // namespace

void UcxTransport::checkPeer(int peer, const char* what) const {
  DDLCOMM_CHECK(peer >= 0 && peer < size_ && peer != rank_, ErrorKind::InvalidArgument, "cannot ", what,
                " rank ", peer, " from rank ", rank_, " in a group of ", size_);
}

UcxTransport::Op& UcxTransport::newOp(OpKind kind, Request* request, int peer) {
  if (free_.empty()) free_.emplace_back();
  active_.splice(active_.end(), free_, free_.begin());
  Op& op = active_.back();
  op = Op{};
  op.owner = this;
  op.self = std::prev(active_.end());
  op.sequence = nextSequence_++;
  op.kind = kind;
  op.request = request;
  op.peer = peer;
  return op;
}

void UcxTransport::submitSend(Op& op, ucp_tag_t tag) {
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_DATATYPE |
                       UCP_OP_ATTR_FLAG_NO_IMM_CMPL;  // one completion path: the callback
  param.cb.send = &UcxTransport::sendDone;
  param.user_data = &op;
  // One buffer travels as contiguous bytes: UCX's rendezvous protocols are fastest for those.
  param.datatype = op.iovCount == 1 ? ucp_dt_make_contig(1) : ucp_dt_make_iov();
  const void* buffer = op.iovCount == 1 ? op.iov[0].buffer : op.iov;
  const size_t count = op.iovCount == 1 ? op.iov[0].length : op.iovCount;
  void* request = ucp_tag_send_nbx(endpoints_[size_t(op.peer)].get(), buffer, count, tag, &param);
  if (UCS_PTR_IS_ERR(request)) {
    complete(op, UCS_PTR_STATUS(request));
  } else {
    op.ucx = request;
  }
}

void UcxTransport::submitRecv(Op& op, ucp_tag_t tag, ucp_tag_t mask) {
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_DATATYPE |
                       UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
  param.cb.recv = &UcxTransport::recvDone;
  param.user_data = &op;
  param.datatype = op.iovCount == 1 ? ucp_dt_make_contig(1) : ucp_dt_make_iov();
  void* buffer = op.iovCount == 1 ? op.iov[0].buffer : op.iov;
  const size_t count = op.iovCount == 1 ? op.iov[0].length : op.iovCount;
  void* request = ucp_tag_recv_nbx(worker_.get(), buffer, count, tag, mask, &param);
  if (UCS_PTR_IS_ERR(request)) {
    complete(op, UCS_PTR_STATUS(request));
  } else {
    op.ucx = request;
  }
}

void UcxTransport::complete(Op& op, ucs_status_t status) {
  op.completed = true;
  op.status = status;
  completed_.push_back(&op);
}

// Callbacks run inside UCX (progress, or the posting call itself): they only record.
void UcxTransport::sendDone(void*, ucs_status_t status, void* user) {
  Op* op = static_cast<Op*>(user);
  op->owner->complete(*op, status);
}

void UcxTransport::recvDone(void*, ucs_status_t status, const ucp_tag_recv_info_t* info, void* user) {
  Op* op = static_cast<Op*>(user);
  op->owner->complete(*op, status);
  if (info) {
    op->senderTag = info->sender_tag;
    op->length = info->length;
  }
}

void UcxTransport::endpointFailed(void* arg, ucp_ep_h, ucs_status_t status) {
  auto* slot = static_cast<PeerFailureSlot*>(arg);
  slot->owner->peerStatus_[size_t(slot->peer)] = status == UCS_OK ? UCS_ERR_CONNECTION_RESET : status;
}

void UcxTransport::postSend(Request& r) {
  guarded([&] {
    throwIfBroken();
    checkPeer(r.peer, "send to");
    const bool p2p = r.signature.op == OpCode::PointToPoint;
    const bool split = !p2p && r.bytes >= kSplitBytes;
    r.transfersLeft = split ? 2 : 1;
    r.failed = false;
    Op& op = newOp(OpKind::Send, &r, r.peer);
    if (peerStatus_[size_t(r.peer)] != UCS_OK) peerLost(r.peer, &op, peerStatus_[size_t(r.peer)]);
    const ucp_tag_t tag = p2p ? makeTag(kPointToPointTag, rank_, r.signature.tag) : makeTag(kCollectiveTag, rank_, 0);
    op.header = makeFrameHeader(r.signature, 0, r.bytes);
    op.iov[0] = {&op.header, sizeof(FrameHeader)};
    op.iov[1] = {r.data, r.bytes};
    op.iovCount = r.bytes && !split ? 2 : 1;
    submitSend(op, tag);
    if (split) {  // the payload follows as its own message, matched next in order
      Op& payload = newOp(OpKind::Send, &r, r.peer);
      payload.iov[0] = {r.data, r.bytes};
      payload.iovCount = 1;
      submitSend(payload, tag);
    }
  });
}

void UcxTransport::postRecv(Request& r) {
  guarded([&] {
    throwIfBroken();
    const bool p2p = r.signature.op == OpCode::PointToPoint;
    const bool any = p2p && r.peer == kAnySource;
    if (!any) checkPeer(r.peer, "receive from");
    const bool split = !p2p && r.bytes >= kSplitBytes;
    r.transfersLeft = split ? 2 : 1;
    r.failed = false;
    Op& op = newOp(any ? OpKind::AnySourceRecv : p2p ? OpKind::PointToPointRecv : OpKind::CollectiveRecv, &r, r.peer);
    op.iov[0] = {&op.header, sizeof(FrameHeader)};
    op.iov[1] = {r.data, r.bytes};
    op.iovCount = r.bytes && !split ? 2 : 1;
    op.headerOnly = split;
    // A peer whose endpoint failed may still have delivered this message: the receive is
    // posted anyway (UCX matches what already arrived), and fails only if it stays pending.
    if (any) {
      submitRecv(op, makeTag(kPointToPointTag, 0, r.signature.tag), kKindMask | kLowMask);
    } else if (p2p) {
      submitRecv(op, makeTag(kPointToPointTag, r.peer, r.signature.tag), ~ucp_tag_t(0));
    } else {
      submitRecv(op, makeTag(kCollectiveTag, r.peer, 0), kKindMask | kSourceMask);
      if (split) {
        Op& payload = newOp(OpKind::CollectiveRecv, &r, r.peer);
        payload.iov[0] = {r.data, r.bytes};
        payload.iovCount = 1;
        payload.payload = true;
        submitRecv(payload, makeTag(kCollectiveTag, r.peer, 0), kKindMask | kSourceMask);
      }
    }
  });
}

bool UcxTransport::progress(bool* completed) {
  bool moved = false;
  while (ucp_worker_progress(worker_.get()) != 0) moved = true;
  if (!completed_.empty()) {
    moved = true;
    if (completed) *completed = true;
    // In posting order, as the messages were sent: a split message's header is checked
    // before its payload. What a throwing finish() leaves stays queued, still in order.
    std::sort(completed_.begin(), completed_.end(), [](const Op* a, const Op* b) { return a->sequence > b->sequence; });
    while (!completed_.empty()) {
      Op& op = *completed_.back();
      completed_.pop_back();
      if (op.ucx) ucp_request_free(op.ucx);
      op.ucx = nullptr;
      free_.splice(free_.begin(), active_, op.self);  // op stays valid: splice moves no element
      if (op.request && !broken_) finish(op);
    }
  }
  checkFailedPeers();
  return moved;
}

void UcxTransport::finish(Op& op) {
  Request& r = *op.request;
  op.request = nullptr;
  try {
    finishUnguarded(op, r);
  } catch (...) {
    // abort() fails the requests operations still point to; this one no longer does.
    r.failed = true;
    r.transfersLeft = 0;
    throw;
  }
}

void UcxTransport::finishUnguarded(Op& op, Request& r) {
  if (op.kind == OpKind::Hello) {
    DDLCOMM_CHECK(op.status == UCS_OK, ErrorKind::PeerFailure, "rank ", rank_, " could not reach rank ", op.peer,
                  " over UCX: ", ucs_status_string(op.status), " (did rank ", op.peer, " exit or crash?)");
    --r.transfersLeft;
    return;
  }
  if (op.kind == OpKind::Send) {
    if (op.status != UCS_OK) peerLost(op.peer, &op, op.status);
    for (size_t i = 0; i < op.iovCount; ++i) bytesSent_ += op.iov[i].length;
    --r.transfersLeft;
    return;
  }
  finishRecv(op, r);
}

void UcxTransport::finishRecv(Op& op, Request& r) {
  const bool any = op.kind == OpKind::AnySourceRecv;
  const bool truncated = op.status == UCS_ERR_MESSAGE_TRUNCATED;
  if (op.status != UCS_OK && !truncated) peerLost(op.peer, &op, op.status);
  const int from = any ? tagSource(op.senderTag) : op.peer;
  if (op.payload) {  // the header before it matched: only its length can be wrong
    if (truncated || op.length != r.bytes) {
      fail(ErrorKind::Mismatch, "collective mismatch between rank ", rank_, " and rank ", from, ": rank ", rank_,
           " is in ", r.signature.describe(), " expecting ", humanBytes(r.bytes), ", but rank ", from, " sent ",
           truncated ? std::string("a longer message") : "a message of " + humanBytes(op.length),
           ". All ranks must call the same collectives in the same order with the same sizes and dtypes");
    }
    --r.transfersLeft;
    return;
  }
  // What the sender sent: its header, which a message too long for the receive may lack.
  std::string sent;
  bool matches = false;
  if (!truncated) {
    DDLCOMM_CHECK(op.length >= sizeof(FrameHeader), ErrorKind::Protocol, "corrupt frame from rank ", from,
                  ": a message of ", op.length, " bytes");
    Signature got = parseFrameHeader(op.header, from);
    const size_t expected = sizeof(FrameHeader) + (op.headerOnly ? 0 : r.bytes);
    matches = got == r.signature && op.header.bytes == r.bytes && op.length == expected && op.header.stripe == 0;
    sent = got.describe() + (op.kind == OpKind::CollectiveRecv ? " with " : ", ") + humanBytes(op.header.bytes);
  } else if (op.header.magic == kFrameMagic && (op.header.bytes > r.bytes || op.headerOnly)) {
    Signature got = parseFrameHeader(op.header, from);
    sent = got.describe() + (op.kind == OpKind::CollectiveRecv ? " with " : ", ") + humanBytes(op.header.bytes);
  } else {
    sent = "a longer message";
    if (op.length > sizeof(FrameHeader) + r.bytes) sent += " of " + humanBytes(op.length - sizeof(FrameHeader));
  }
  if (!matches) {
    if (op.kind == OpKind::CollectiveRecv) {
      fail(ErrorKind::Mismatch, "collective mismatch between rank ", rank_, " and rank ", from, ": rank ", rank_,
           " is in ", r.signature.describe(), " expecting ", humanBytes(r.bytes), ", but rank ", from, " sent ", sent,
           ". All ranks must call the same collectives in the same order with the same sizes and dtypes");
    }
    fail(ErrorKind::Mismatch, "rank ", rank_, " posted a receive for ", r.signature.describe(), ", ",
         humanBytes(r.bytes), any ? " from any rank" : "", ", but rank ", from, " sent ", sent);
  }
  if (any) r.peer = from;
  --r.transfersLeft;
}

void UcxTransport::checkFailedPeers() {
  if (broken_) return;
  for (int p = 0; p < size_; ++p) {
    if (peerStatus_[size_t(p)] == UCS_OK) continue;
    for (const Op& op : active_) {
      if (!op.completed && op.request && (op.peer == p || op.kind == OpKind::AnySourceRecv)) {
        peerLost(p, &op, peerStatus_[size_t(p)]);
      }
    }
  }
}

void UcxTransport::peerLost(int peer, const Op* op, ucs_status_t status) {
  std::string context;
  if (op && op->request && op->kind != OpKind::Hello) {
    context = (op->kind == OpKind::Send ? " while sending " : " while receiving ") + op->request->signature.describe();
  }
  const PeerProcess& process = processes_[size_t(peer)];
  const std::string what = process.exited ? detail::concat("its process ", process.pid, " on this host has exited")
                                          : detail::concat("UCX reports ", ucs_status_string(status));
  fail(ErrorKind::PeerFailure, "rank ", rank_, " lost its connection to rank ", peer, context, ": ", what,
       " (did rank ", peer, " exit or crash?)");
}

void UcxTransport::checkPeerProcesses() {
  for (int p = 0; p < size_; ++p) {
    PeerProcess& process = processes_[size_t(p)];
    if (!process.watched || process.exited) continue;
    if (processStartTime(std::to_string(process.pid)) != process.startTime) {
      process.exited = true;
      peerStatus_[size_t(p)] = UCS_ERR_CONNECTION_RESET;
    }
  }
}

bool UcxTransport::waitForEvents(int timeoutMs) {
  // BUSY: events arrived since the last progress; the caller progresses again.
  ucs_status_t status = ucp_worker_arm(worker_.get());
  if (status == UCS_ERR_BUSY) return true;
  if (status != UCS_OK) {
    abort(ErrorKind::System, detail::concat("ucp_worker_arm: ", ucs_status_string(status)));
    throwIfBroken();
  }
  pollfd fd{eventFd_, POLLIN, 0};
  int n = ::poll(&fd, 1, timeoutMs);
  if (n < 0 && errno != EINTR) {
    abort(ErrorKind::System, systemErrorText("poll", errno));
    throwIfBroken();
  }
  return n > 0;
}

void UcxTransport::wait(Request& r, Deadline deadline) {
  // UCX's progress counts its own housekeeping too, so "a second without progress" is a
  // second in which no operation of this transport completed.
  Clock::time_point lastCompletion = Clock::now(), lastActive = lastCompletion;
  while (!r.done()) {
    throwIfBroken();
    bool active = false, completed = false;
    guarded([&] { active = progress(&completed); });
    if (r.done()) break;
    const Clock::time_point now = Clock::now();
    if (completed) lastCompletion = now;
    if (active || completed) lastActive = now;
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - now).count();
    if (left <= 0) timedOut(r);
    auto idle = std::chrono::duration_cast<std::chrono::milliseconds>(now - lastCompletion).count();
    if (idle >= 1000) {
      lastCompletion = now;
      checkPeerProcesses();
      guarded([&] { checkFailedPeers(); });
      if (failureProbe_ && failureProbe_()) {
        abort(ErrorKind::PeerFailure, detail::concat("rank ", rank_, " gave up waiting in ", r.signature.describe(),
                                                     " for rank ", r.peer, ": another rank failed"));
        throwIfBroken();
      }
      continue;
    }
    // Spinning a little before sleeping catches the peer's next message without the cost
    // of arming the worker and a system call.
    if (now - lastActive < spin_.duration) {
      if (spin_.yield) sched_yield();
      continue;
    }
    if (!active) waitForEvents(int(std::min<long long>({left + 1, 1000 - idle})));
  }
  if (r.failed) throwIfBroken();
}

void UcxTransport::poll(std::chrono::milliseconds timeout) {
  throwIfBroken();
  bool moved = false;
  guarded([&] { moved = progress(); });
  if (moved) return;
  if (waitForEvents(int(timeout.count()))) guarded([&] { progress(); });
}

void UcxTransport::wakeup() {
  if (worker_) ucp_worker_signal(worker_.get());
}

TransportStats UcxTransport::stats() const {
  TransportStats s;
  s.network = "ucx";
  s.connectionsPerPeer.assign(size_t(size_), 0);
  for (int p = 0; p < size_; ++p) {
    if (endpoints_[size_t(p)].get() && peerStatus_[size_t(p)] == UCS_OK) s.connectionsPerPeer[size_t(p)] = 1;
  }
  s.bytesSent = bytesSent_;
  s.spinMicros = spin_.duration.count();
  return s;
}

void UcxTransport::timedOut(const Request& r) {
  const std::string peer = r.peer == kAnySource ? "any rank" : "rank " + std::to_string(r.peer);
  std::string message = detail::concat("rank ", rank_, ": Timed out in ", r.signature.describe(), " waiting for ", peer,
                                       ": ", peer, " may be stuck, slower than the timeout, or in a different collective");
  abort(ErrorKind::Timeout, message);
  throwIfBroken();
  throw Error(ErrorKind::Timeout, message);
}

void UcxTransport::abort(ErrorKind kind, const std::string& reason) noexcept {
  if (broken_) return;
  broken_ = true;
  brokenKind_ = kind;
  brokenReason_ = failureMessage(kind, reason);
  bool idle = true;
  for (Op& op : active_) {
    if (op.request) {
      op.request->failed = true;
      op.request->transfersLeft = 0;
      op.request = nullptr;
    }
    if (op.completed) continue;
    idle = false;
    // Receives write into buffers their owners may free once failed: take them back from UCX.
    if (op.ucx && op.kind != OpKind::Send) ucp_request_cancel(worker_.get(), op.ucx);
  }
  if (!worker_) return;
  // A clean shutdown flushes (messages already sent still reach peers that wait for them);
  // a failure closes at once, which the peers see as this rank's endpoints failing.
  closeEndpoints(/*force=*/kind != ErrorKind::Aborted || !idle);
}

void UcxTransport::closeEndpoints(bool force) noexcept {
  std::vector<void*> closing;
  for (Endpoint& ep : endpoints_) {
    if (!ep.get()) continue;
    if (void* request = ep.close(force)) closing.push_back(request);
  }
  // Bounded: a flush to a peer that died needs its error to be detected.
  const Deadline until = Clock::now() + std::chrono::milliseconds(force ? 200 : 2000);
  auto pending = [&] {
    return std::any_of(closing.begin(), closing.end(),
                       [](void* r) { return ucp_request_check_status(r) == UCS_INPROGRESS; });
  };
  while (pending() && Clock::now() < until) {
    if (ucp_worker_progress(worker_.get()) == 0) {
      ucs_status_t armed = ucp_worker_arm(worker_.get());
      if (armed == UCS_OK) {
        pollfd fd{eventFd_, POLLIN, 0};
        ::poll(&fd, 1, 10);
      }
    }
  }
  // Operations that completed during the closes (sends, cancelled receives) hold UCX requests.
  for (Op& op : active_) {
    if (op.completed && op.ucx) {
      ucp_request_free(op.ucx);
      op.ucx = nullptr;
    }
  }
  for (void* r : closing) ucp_request_free(r);
}

void UcxTransport::throwIfBroken() const {
  if (broken_) throw Error(brokenKind_, brokenReason_);
}

}  // namespace ddlcomm::ucx
