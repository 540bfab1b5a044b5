// The UCX transport's connection set-up: worker addresses through the store, one endpoint per
// peer, and a proof of the group key from each before any data moves.
#include <ucs/debug/log_def.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <optional>
#include <sstream>
#include <tuple>

#include "common/env.h"
#include "common/sha256.h"
#include "transport/handshake.h"
#include "transport/ucx/ucx_internal.h"
#include "transport/ucx/ucx_transport.h"


namespace ddlcomm::ucx {
using namespace internal;
namespace {

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

// UCX's tcp transport copies through 8 KiB send and 64 KiB receive segments by default; with
// these larger ones, ring all-reduce over it comes much closer to ddlcomm's own TCP from 1 MiB
// up (docs/results/transports.md, "UCX's tcp segment sizes"). They are a pair (UCX refuses a
// receive segment smaller than the send segment): where either variable is set, UCX's own
// settings apply to both.
// UCX applies a modified transport setting by its name within the transport's table, without
// the "TCP_" prefix; only tcp has these two.
struct ConfigDefault {
  const char* variable;
  const char* key;
  const char* value;
};
constexpr ConfigDefault kConfigDefaults[] = {
    {"UCX_TCP_TX_SEG_SIZE", "TX_SEG_SIZE", "256K"},
    {"UCX_TCP_RX_SEG_SIZE", "RX_SEG_SIZE", "1M"},
};

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

// Drops UCX's log messages while installed.
ucs_log_func_rc_t dropLog(const char*, unsigned, const char*, ucs_log_level_t, const ucs_log_component_config_t*,
                          const char*, va_list) {
  return UCS_LOG_FUNC_RC_STOP;
}

}  // namespace

namespace internal {

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

void check(ucs_status_t status, const char* what) {
  DDLCOMM_CHECK(status == UCS_OK, ErrorKind::System, what, ": ", ucs_status_string(status));
}

QuietUcxLog::QuietUcxLog() { ucs_log_push_handler(&dropLog); }
QuietUcxLog::~QuietUcxLog() { ucs_log_pop_handler(); }

}  // namespace internal

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

UcxTransport::UcxTransport(int rank, int size) : rank_(rank), size_(size) {
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
  ucp_config_t* raw = nullptr;
  check(ucp_config_read(nullptr, nullptr, &raw), "ucp_config_read");  // honours UCX_* variables
  std::unique_ptr<ucp_config_t, void (*)(ucp_config_t*)> config(raw, ucp_config_release);
  const bool userSet = std::any_of(std::begin(kConfigDefaults), std::end(kConfigDefaults),
                                   [](const ConfigDefault& d) { return std::getenv(d.variable) != nullptr; });
  // Accepted even where no transport has the setting (a UCX without tcp), which needs none.
  for (const ConfigDefault& d : kConfigDefaults) {
    if (!userSet) check(ucp_config_modify(config.get(), d.key, d.value), "ucp_config_modify");
  }
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES;
  params.features = UCP_FEATURE_TAG | UCP_FEATURE_WAKEUP;
  ucp_context_h context = nullptr;
  ucs_status_t status = ucp_init(&params, config.get(), &context);
  check(status, "ucp_init");
  context_.reset(context);

  // Serialized: the executor drives the transport, or a caller running an operation inline
  // while the executor is idle (the executor's mutex orders the hand-overs); ucp_worker_signal
  // is the one call made concurrently, and UCX documents it as safe from any thread.
  ucp_worker_params_t workerParams{};
  workerParams.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  workerParams.thread_mode = UCS_THREAD_MODE_SERIALIZED;
  ucp_worker_h worker = nullptr;
  check(ucp_worker_create(context_.get(), &workerParams, &worker), "ucp_worker_create");
  worker_.reset(worker);
  check(ucp_worker_get_efd(worker_.get(), &eventFd_), "ucp_worker_get_efd");
  if (size_ == 1) return;

  const Deadline deadline = Clock::now() + connectTimeout;
  const std::string key = transport::groupKey(store, rank_);
  ucp_address_t* address = nullptr;
  size_t addressBytes = 0;
  check(ucp_worker_get_address(worker_.get(), &address, &addressBytes), "ucp_worker_get_address");
  // "<address>;<host and pid namespace>;<pid>;<start time>"
  const std::string myPid = std::to_string(::getpid()), myNamespace = processNamespace();
  const std::string published = toHex(address, addressBytes) + ";" + myNamespace + ";" + myPid + ";" +
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
      process.watched = space == myNamespace && !pid.empty() && !startTime.empty();
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
        request->transfersLeft = 1;
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
          const bool active = progress();  // may stay true for UCX's housekeeping: check the deadline anyway
          if (r->done()) break;
          auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
          if (left <= 0) {
            std::string missing;
            for (int p = 0; p < size_; ++p) {
              if (p != rank_ && !(sends[size_t(p)].done() && recvs[size_t(p)].done())) {
                missing += (missing.empty() ? "" : ", ") + std::to_string(p);
              }
            }
            fail(ErrorKind::Timeout, "rank ", rank_, ": Timed out connecting over UCX (still missing rank ", missing,
                 ")");
          }
          if (!active) waitForEvents(int(std::min<long long>(left + 1, 100)));
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

}  // namespace ddlcomm::ucx
