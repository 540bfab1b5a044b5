#include "transport/ucx/ucx_transport.h"

#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <optional>
#include <sstream>

#include <ucs/debug/log_def.h>

#include "common/env.h"
#include "common/sha256.h"
#include "transport/tcp/handshake.h"

namespace ddlcomm::ucx {
namespace {

constexpr int kKindShift = 62;
constexpr int kSourceShift = 40;
constexpr int kMaxRanks = 1 << 22;
// Collective messages from this size on travel as two messages, header then payload, so the
// payload is contiguous: UCX's rendezvous is about twice as fast for contiguous buffers as
// for an iov (ucx_perftest over tcp, 16 MiB). Smaller ones go whole, as one iov message.
constexpr size_t kSplitBytes = 16384;
constexpr ucp_tag_t kLowMask = (ucp_tag_t(1) << kSourceShift) - 1;
constexpr ucp_tag_t kKindMask = ucp_tag_t(3) << kKindShift;
constexpr ucp_tag_t kSourceMask = ucp_tag_t(kMaxRanks - 1) << kSourceShift;
enum TagKind : ucp_tag_t { kHelloTag = 0, kCollectiveTag = 1, kPointToPointTag = 2 };

ucp_tag_t makeTag(TagKind kind, int source, uint64_t low) {
  return (ucp_tag_t(kind) << kKindShift) | (ucp_tag_t(source) << kSourceShift) | (low & kLowMask);
}
int tagSource(ucp_tag_t tag) { return int((tag & kSourceMask) >> kSourceShift); }

// The first message on each endpoint: proves the group key for this ordered pair of ranks.
struct HelloMessage {
  uint32_t magic;
  uint32_t version;
  int32_t rank;
  int32_t size;
  Digest mac;
};
constexpr uint32_t kHelloMagic = 0x58435544;  // "DUCX"
constexpr uint32_t kHelloVersion = 1;

Digest helloMac(const std::string& key, int from, int to, int size) {
  const std::string pair = detail::concat(from, ">", to, "/", size);
  return hmacSha256(key, {"ddlcomm ucx hello", pair});
}

std::string toHex(const void* data, size_t bytes) {
  static const char digits[] = "0123456789abcdef";
  std::string out;
  out.reserve(bytes * 2);
  for (size_t i = 0; i < bytes; ++i) {
    uint8_t b = static_cast<const uint8_t*>(data)[i];
    out += digits[b >> 4];
    out += digits[b & 15];
  }
  return out;
}

std::string fromHex(const std::string& text, int peer) {
  auto value = [&](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    fail(ErrorKind::Protocol, "the UCX address of rank ", peer, " in the store is corrupt");
  };
  DDLCOMM_CHECK(text.size() % 2 == 0 && !text.empty(), ErrorKind::Protocol, "the UCX address of rank ", peer,
                " in the store is corrupt");
  std::string out(text.size() / 2, '\0');
  for (size_t i = 0; i < out.size(); ++i) out[i] = char(value(text[2 * i]) << 4 | value(text[2 * i + 1]));
  return out;
}

// This process's host and pid namespace: peers with the same one can look up its pid.
std::string processNamespace() {
  std::ifstream bootId("/proc/sys/kernel/random/boot_id");
  std::string boot;
  std::getline(bootId, boot);
  char link[128] = {};
  ssize_t n = ::readlink("/proc/self/ns/pid", link, sizeof link - 1);
  return boot + "/" + std::string(link, n > 0 ? size_t(n) : 0);
}

// Field 22 (start time) of /proc/<pid>/stat, or "" once the process is gone or a zombie.
std::string processStartTime(const std::string& pid) {
  std::ifstream file("/proc/" + pid + "/stat");
  std::string stat;
  if (!std::getline(file, stat)) return "";
  size_t end = stat.rfind(')');  // the command name may hold spaces
  if (end == std::string::npos) return "";
  std::istringstream fields(stat.substr(end + 1));
  std::string field;
  for (int i = 3; i <= 22 && fields >> field; ++i) {
    if (i == 3 && (field == "Z" || field == "X")) return "";
    if (i == 22) return field;
  }
  return "";
}

// Drops UCX's log messages while installed (see QuietUcxLog).
ucs_log_func_rc_t dropLog(const char*, unsigned, const char*, ucs_log_level_t, const ucs_log_component_config_t*,
                          const char*, va_list) {
  return UCS_LOG_FUNC_RC_STOP;
}

// Silences UCX's own logging for its lifetime, where UCX reports as errors what this
// transport expects and handles (an endpoint with peer failure handling to a peer only
// shared memory reaches; teardown after a failure).
struct QuietUcxLog {
  QuietUcxLog() { ucs_log_push_handler(&dropLog); }
  ~QuietUcxLog() { ucs_log_pop_handler(); }
};

std::string humanBytes(size_t bytes) { return detail::concat(bytes, " bytes"); }

void check(ucs_status_t status, const char* what) {
  DDLCOMM_CHECK(status == UCS_OK, ErrorKind::System, what, ": ", ucs_status_string(status));
}

}  // namespace

UcxTransport::Endpoint& UcxTransport::Endpoint::operator=(Endpoint&& o) noexcept {
  std::swap(ep_, o.ep_);
  return *this;
}

UcxTransport::Endpoint::~Endpoint() {
  if (ep_) {
    void* request = close(true);
    if (request) ucp_request_free(request);  // completes in the background
  }
}

void* UcxTransport::Endpoint::close(bool force) {
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  param.flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0;
  void* request = ucp_ep_close_nbx(ep_, &param);
  ep_ = nullptr;
  return UCS_PTR_IS_PTR(request) ? request : nullptr;
}

UcxTransport::UcxTransport(int rank, int size)
    : rank_(rank), size_(size), spin_(envInteger("DDLCOMM_UCX_SPIN_US", 0, 0, 1000000)) {
  endpoints_.resize(size_t(size));
  failureSlots_.resize(size_t(size));
  peerStatus_.assign(size_t(size), UCS_OK);
  processes_.resize(size_t(size));
  for (int p = 0; p < size; ++p) failureSlots_[size_t(p)] = PeerFailureSlot{this, p};
}

UcxTransport::~UcxTransport() {
  abort(ErrorKind::Aborted, "transport destroyed");
  // abort() cancelled what it could; release the rest (UCX then calls no callback for them).
  for (Op& op : active_) {
    if (op.ucx) ucp_request_free(op.ucx);
  }
  // After a failure UCX warns at teardown about what the failure left behind (messages no
  // receive matched, requests released in flight): expected then, so not printed.
  std::optional<QuietUcxLog> quiet;
  if (brokenKind_ != ErrorKind::Aborted) quiet.emplace();
  endpoints_.clear();
  worker_.reset();
  context_.reset();
}

std::unique_ptr<UcxTransport> UcxTransport::connect(int rank, int size, KeyValueStore& store,
                                                    std::chrono::milliseconds connectTimeout) {
  DDLCOMM_CHECK(size >= 1 && rank >= 0 && rank < size, ErrorKind::InvalidArgument, "invalid rank ", rank,
                " for world size ", size);
  DDLCOMM_CHECK(size <= kMaxRanks, ErrorKind::InvalidArgument, "the UCX transport supports at most ", kMaxRanks,
                " ranks, not ", size);
  std::unique_ptr<UcxTransport> t(new UcxTransport(rank, size));
  t->establish(store, connectTimeout);
  return t;
}

void UcxTransport::establish(KeyValueStore& store, std::chrono::milliseconds connectTimeout) {
  ucp_config_t* config = nullptr;
  check(ucp_config_read(nullptr, nullptr, &config), "ucp_config_read");  // honours UCX_* variables
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES;
  params.features = UCP_FEATURE_TAG | UCP_FEATURE_WAKEUP;
  ucp_context_h context = nullptr;
  ucs_status_t status = ucp_init(&params, config, &context);
  ucp_config_release(config);
  check(status, "ucp_init");
  context_.reset(context);

  // Single-threaded: only the executor drives the transport; ucp_worker_signal is the one
  // call other threads make, and UCX documents it as safe from any thread.
  ucp_worker_params_t workerParams{};
  workerParams.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  workerParams.thread_mode = UCS_THREAD_MODE_SINGLE;
  ucp_worker_h worker = nullptr;
  check(ucp_worker_create(context_.get(), &workerParams, &worker), "ucp_worker_create");
  worker_.reset(worker);
  check(ucp_worker_get_efd(worker_.get(), &eventFd_), "ucp_worker_get_efd");
  if (size_ == 1) return;

  const Deadline deadline = Clock::now() + connectTimeout;
  const std::string key = tcp::groupKey(store, rank_);
  ucp_address_t* address = nullptr;
  size_t addressBytes = 0;
  check(ucp_worker_get_address(worker_.get(), &address, &addressBytes), "ucp_worker_get_address");
  // "<address>;<host and pid namespace>;<pid>;<start time>"
  const std::string myPid = std::to_string(::getpid());
  const std::string published = toHex(address, addressBytes) + ";" + processNamespace() + ";" + myPid + ";" +
                                processStartTime(myPid);
  ucp_worker_release_address(worker_.get(), address);
  store.set("ddlcomm/ucx/addr/" + std::to_string(rank_), published);

  for (int peer = 0; peer < size_; ++peer) {
    if (peer == rank_) continue;
    std::istringstream fields(store.get("ddlcomm/ucx/addr/" + std::to_string(peer)));
    std::string hex, space, pid, startTime;
    std::getline(fields, hex, ';');
    std::getline(fields, space, ';');
    std::getline(fields, pid, ';');
    std::getline(fields, startTime, ';');
    const std::string remote = fromHex(hex, peer);
    ucp_ep_params_t ep{};
    ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                    UCP_EP_PARAM_FIELD_ERR_HANDLER;
    ep.address = reinterpret_cast<const ucp_address_t*>(remote.data());
    ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;  // a dead peer fails its endpoint instead of hanging it
    ep.err_handler.cb = &UcxTransport::endpointFailed;
    ep.err_handler.arg = &failureSlots_[size_t(peer)];
    ucp_ep_h handle = nullptr;
    {
      QuietUcxLog quiet;
      status = ucp_ep_create(worker_.get(), &ep, &handle);
    }
    if (status == UCS_ERR_UNREACHABLE) {  // only transports without failure reports reach it
      ep.field_mask &= ~uint64_t(UCP_EP_PARAM_FIELD_ERR_HANDLER);
      ep.err_mode = UCP_ERR_HANDLING_MODE_NONE;
      status = ucp_ep_create(worker_.get(), &ep, &handle);
      PeerProcess& process = processes_[size_t(peer)];
      process.watched = space == processNamespace() && !pid.empty() && !startTime.empty();
      process.pid = std::atol(pid.c_str());
      process.startTime = startTime;
    }
    DDLCOMM_CHECK(status == UCS_OK, ErrorKind::PeerFailure, "rank ", rank_, " cannot create a UCX endpoint to rank ",
                  peer, ": ", ucs_status_string(status));
    endpoints_[size_t(peer)] = Endpoint(handle);
  }

  // Every pair exchanges proofs of the group key; this also wires up every endpoint.
  std::vector<HelloMessage> mine(static_cast<size_t>(size_)), theirs(static_cast<size_t>(size_));
  std::vector<Request> sends(static_cast<size_t>(size_)), recvs(static_cast<size_t>(size_));
  guarded([&] {
    for (int peer = 0; peer < size_; ++peer) {
      if (peer == rank_) continue;
      HelloMessage& h = mine[size_t(peer)];
      h = HelloMessage{kHelloMagic, kHelloVersion, rank_, size_, helloMac(key, rank_, peer, size_)};
      for (auto [request, buffer, isSend] : {std::tuple{&recvs[size_t(peer)], &theirs[size_t(peer)], false},
                                             std::tuple{&sends[size_t(peer)], &h, true}}) {
        request->peer = peer;
        request->data = reinterpret_cast<char*>(buffer);
        request->bytes = sizeof(HelloMessage);
        request->piecesLeft = 1;
        Op& op = newOp(OpKind::Hello, request, peer);
        op.iov[0] = {buffer, sizeof(HelloMessage)};
        op.iovCount = 1;
        if (isSend) {
          submitSend(op, makeTag(kHelloTag, rank_, 0));
        } else {
          submitRecv(op, makeTag(kHelloTag, peer, 0), ~ucp_tag_t(0));
        }
      }
    }
    for (int peer = 0; peer < size_; ++peer) {
      if (peer == rank_) continue;
      for (Request* r : {&sends[size_t(peer)], &recvs[size_t(peer)]}) {
        while (!r->done()) {
          if (progress()) continue;
          auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
          if (left <= 0) {
            std::string missing;
            for (int p = 0; p < size_; ++p) {
              if (p != rank_ && !(sends[size_t(p)].done() && recvs[size_t(p)].done())) {
                missing += (missing.empty() ? "" : ", ") + std::to_string(p);
              }
            }
            fail(ErrorKind::Timeout, "rank ", rank_, " timed out connecting over UCX (still missing rank ", missing,
                 ")");
          }
          waitForEvents(int(std::min<long long>(left + 1, 100)));
        }
      }
      const HelloMessage& h = theirs[size_t(peer)];
      DDLCOMM_CHECK(h.magic == kHelloMagic && h.version == kHelloVersion, ErrorKind::Protocol, "rank ", peer,
                    " sent a malformed UCX hello: mixed ddlcomm versions in one job?");
      DDLCOMM_CHECK(digestEqual(h.mac, helloMac(key, peer, rank_, size_)), ErrorKind::Protocol, "rank ", peer,
                    "'s UCX endpoint failed to prove the group key: it is not a rank of this group");
      DDLCOMM_CHECK(h.rank == peer && h.size == size_, ErrorKind::Mismatch, "UCX address of rank ", peer,
                    " answered as rank ", h.rank, " of ", h.size, "; this rank has world size ", size_);
    }
  });
}

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
    op.completed = true;
    op.status = UCS_PTR_STATUS(request);
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
    op.completed = true;
    op.status = UCS_PTR_STATUS(request);
  } else {
    op.ucx = request;
  }
}

// Callbacks run inside UCX (progress, or the posting call itself): they only record.
void UcxTransport::sendDone(void*, ucs_status_t status, void* user) {
  Op* op = static_cast<Op*>(user);
  op->completed = true;
  op->status = status;
}

void UcxTransport::recvDone(void*, ucs_status_t status, const ucp_tag_recv_info_t* info, void* user) {
  Op* op = static_cast<Op*>(user);
  op->completed = true;
  op->status = status;
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
    r.piecesLeft = split ? 2 : 1;
    r.failed = false;
    Op& op = newOp(OpKind::Send, &r, r.peer);
    if (peerStatus_[size_t(r.peer)] != UCS_OK) peerLost(r.peer, &op, peerStatus_[size_t(r.peer)]);
    const ucp_tag_t tag = p2p ? makeTag(kPointToPointTag, rank_, r.signature.seq) : makeTag(kCollectiveTag, rank_, 0);
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
    r.piecesLeft = split ? 2 : 1;
    r.failed = false;
    Op& op = newOp(any ? OpKind::AnySourceRecv : p2p ? OpKind::PointToPointRecv : OpKind::CollectiveRecv, &r, r.peer);
    op.iov[0] = {&op.header, sizeof(FrameHeader)};
    op.iov[1] = {r.data, r.bytes};
    op.iovCount = r.bytes && !split ? 2 : 1;
    op.headerOnly = split;
    // A peer whose endpoint failed may still have delivered this message: the receive is
    // posted anyway (UCX matches what already arrived), and fails only if it stays pending.
    if (any) {
      submitRecv(op, makeTag(kPointToPointTag, 0, r.signature.seq), kKindMask | kLowMask);
    } else if (p2p) {
      submitRecv(op, makeTag(kPointToPointTag, r.peer, r.signature.seq), ~ucp_tag_t(0));
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
  for (auto it = active_.begin(); it != active_.end();) {
    auto next = std::next(it);
    if (it->completed) {
      moved = true;
      if (completed) *completed = true;
      if (it->ucx) ucp_request_free(it->ucx);
      it->ucx = nullptr;
      Op& op = *it;
      free_.splice(free_.begin(), active_, it);  // op stays valid: splice moves no element
      if (op.request && !broken_) finish(op);
    }
    it = next;
  }
  checkFailedPeers();
  return moved;
}

void UcxTransport::finish(Op& op) {
  Request& r = *op.request;
  op.request = nullptr;
  if (op.kind == OpKind::Hello) {
    DDLCOMM_CHECK(op.status == UCS_OK, ErrorKind::PeerFailure, "rank ", rank_, " could not reach rank ", op.peer,
                  " over UCX: ", ucs_status_string(op.status), " (did rank ", op.peer, " exit or crash?)");
    --r.piecesLeft;
    return;
  }
  if (op.kind == OpKind::Send) {
    if (op.status != UCS_OK) peerLost(op.peer, &op, op.status);
    for (size_t i = 0; i < op.iovCount; ++i) bytesSent_ += op.iov[i].length;
    --r.piecesLeft;
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
    --r.piecesLeft;
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
    matches = got == r.signature && op.header.bytes == r.bytes && op.length == expected && op.header.piece == 0;
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
  --r.piecesLeft;
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
    if (now - lastActive < spin_) continue;
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
  s.connectionsPerPeer.assign(size_t(size_), 0);
  for (int p = 0; p < size_; ++p) {
    if (endpoints_[size_t(p)].get() && peerStatus_[size_t(p)] == UCS_OK) s.connectionsPerPeer[size_t(p)] = 1;
  }
  s.bytesSent = bytesSent_;
  return s;
}

void UcxTransport::timedOut(const Request& r) {
  const std::string peer = r.peer == kAnySource ? "any rank" : "rank " + std::to_string(r.peer);
  std::string message = detail::concat("rank ", rank_, " timed out in ", r.signature.describe(), " waiting for ", peer,
                                       ": ", peer, " may be stuck, slower than the timeout, or in a different collective");
  abort(ErrorKind::Timeout, message);
  throwIfBroken();
  throw Error(ErrorKind::Timeout, message);
}

void UcxTransport::abort(ErrorKind kind, const std::string& reason) noexcept {
  if (broken_) return;
  broken_ = true;
  brokenKind_ = kind;
  brokenReason_ = reason;
  if (failureHook_ && kind != ErrorKind::Aborted) {  // not for a deliberate shutdown
    try {
      brokenReason_ = failureHook_(kind, reason);
    } catch (...) {
      // Keep the local reason; the hook is best effort.
    }
  }
  bool idle = true;
  for (Op& op : active_) {
    if (op.request) {
      op.request->failed = true;
      op.request->piecesLeft = 0;
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
  // Sends and cancelled receives complete during the closes: mark them done now.
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
