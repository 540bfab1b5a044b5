#include "torch/process_group_transport.h"

#include <ATen/Functions.h>

#include <algorithm>
#include <cstring>
#include <thread>

namespace ddlcomm::torch_glue {
namespace {

constexpr int kTagBit = 1 << 30;
constexpr uint32_t kStepLimit = 1u << 15;  // steps per peer per call
constexpr uint64_t kSignatureMagic = 0x474953444c4443ull;  // "CDLDSIG"

int tagOf(const Signature& signature) {
  DDLCOMM_CHECK(signature.step < kStepLimit, ErrorKind::InvalidArgument, signature.describe(),
                ": more messages between two ranks in one call than a process group's tags number (",
                kStepLimit, ")");
  return kTagBit | int((signature.tag & 0x7fff) << 15) | int(signature.step);
}

at::Tensor bytesAt(void* data, size_t bytes) {
  return at::from_blob(data, {int64_t(bytes)}, at::TensorOptions().dtype(at::kByte));
}

}  // namespace

ProcessGroupTransport::Header ProcessGroupTransport::headerOf(const Request& r) {
  return {kSignatureMagic, (uint64_t(r.signature.op) << 8) | uint64_t(r.signature.dtype), r.signature.tag,
          r.signature.count, uint64_t(r.bytes)};
}

ProcessGroupTransport::ProcessGroupTransport(c10::intrusive_ptr<c10d::Backend> carrier)
    : carrier_(std::move(carrier)),
      rank_(carrier_->getRank()),
      size_(carrier_->getSize()),
      staging_(2 * size_t(size_)) {}

// Work still posted belongs to a failed group: the carrier cannot cancel it, only finish or fail it.
ProcessGroupTransport::~ProcessGroupTransport() = default;

void ProcessGroupTransport::postSend(Request& r) { post(r, false); }

void ProcessGroupTransport::postRecv(Request& r) {
  DDLCOMM_CHECK(r.peer != kAnySource, ErrorKind::InvalidArgument,
                "a receive from any rank over another backend's group");
  post(r, true);
}

void ProcessGroupTransport::post(Request& r, bool isRecv) {
  throwIfBroken();
  InFlight f;
  f.isRecv = isRecv;
  auto move = [&](void* data, size_t bytes) {
    std::vector<at::Tensor> tensors{bytesAt(data, bytes)};
    const int tag = tagOf(r.signature);
    return isRecv ? carrier_->recv(tensors, r.peer, tag) : carrier_->send(tensors, r.peer, tag);
  };
  guarded([&] {
    try {
      if (r.signature.step == 0) {
        // The call's first message to this peer: its signature in front of its bytes, one
        // message (a separate one would cost the carrier's latency once more per call).
        std::vector<uint8_t>& staging = stagingFor(r.peer, isRecv, sizeof(Header) + r.bytes);
        const Header header = isRecv ? Header{} : headerOf(r);  // a receive's is filled by the peer's
        std::memcpy(staging.data(), header.data(), sizeof(Header));
        if (!isRecv && r.bytes) std::memcpy(staging.data() + sizeof(Header), r.data, r.bytes);
        f.staging = staging.data();
        f.work = move(staging.data(), sizeof(Header) + r.bytes);
      } else if (r.bytes) {
        f.work = move(r.data, r.bytes);
      }
    } catch (const std::exception& e) {
      fail(ErrorKind::PeerFailure, isRecv ? "receiving " : "sending ", r.signature.describe(),
           isRecv ? " from rank " : " to rank ", r.peer, " over the ", carrier_->getBackendName(), " group: ",
           e.what());
    }
  });
  if (!isRecv) bytesSent_ += r.bytes;
  r.failed = false;
  r.transfersLeft = 1;
  inFlight_[&r] = std::move(f);
}

std::vector<uint8_t>& ProcessGroupTransport::stagingFor(int peer, bool isRecv, size_t bytes) {
  std::vector<uint8_t>& staging = staging_[2 * size_t(peer) + (isRecv ? 1 : 0)];
  if (staging.size() < bytes) staging.resize(bytes);
  return staging;
}

void ProcessGroupTransport::waitWork(const c10::intrusive_ptr<c10d::Work>& work, const Request& r,
                                     Deadline deadline) {
  if (!work) return;
  guarded([&] {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    try {
      // c10d reads a zero timeout as "the group's own": at least a millisecond.
      work->wait(std::max(left, std::chrono::milliseconds(1)));
    } catch (const std::exception& e) {
      const std::string what = e.what();
      const bool timedOut = Clock::now() >= deadline || what.find("imed out") != std::string::npos;
      fail(timedOut ? ErrorKind::Timeout : ErrorKind::PeerFailure, r.signature.describe(), " with rank ", r.peer,
           " over the ", carrier_->getBackendName(), " group ", timedOut ? "timed out" : "failed", ": ", what);
    }
  });
}

void ProcessGroupTransport::checkSignature(const Request& r, const Header& theirs) {
  const Header mine = headerOf(r);
  if (theirs == mine) return;
  guarded([&] {
    DDLCOMM_CHECK(theirs[0] == kSignatureMagic, ErrorKind::Protocol, "rank ", r.peer, " sent a message tagged as ",
                  r.signature.describe(), " that is not ddlcomm's");
    if (std::equal(mine.begin(), mine.end() - 1, theirs.begin())) {  // the same call: only the size differs
      fail(ErrorKind::Mismatch, "rank ", r.peer, " sent ", theirs[4], " bytes in ", r.signature.describe(),
           " where rank ", rank_, " expects ", r.bytes);
    }
    Signature other = r.signature;
    other.op = OpCode(uint8_t(theirs[1] >> 8));
    other.dtype = DataType(uint8_t(theirs[1] & 0xff));
    other.tag = theirs[2];
    other.count = theirs[3];
    fail(ErrorKind::Mismatch, "rank ", r.peer, " is in ", other.describe(), " while rank ", rank_, " is in ",
         r.signature.describe());
  });
}

void ProcessGroupTransport::wait(Request& r, Deadline deadline) {
  auto it = inFlight_.find(&r);
  if (it == inFlight_.end()) {
    throwIfBroken();
    return;  // done already (poll completed it)
  }
  InFlight f = std::move(it->second);
  inFlight_.erase(it);
  waitWork(f.work, r, deadline);
  if (f.isRecv && f.staging) {
    // A shorter message than expected fills the staging buffer's front only: the header
    // then names another size or call (a longer one is refused by the carrier itself).
    Header theirs;
    std::memcpy(theirs.data(), f.staging, sizeof(Header));
    checkSignature(r, theirs);
    if (r.bytes) std::memcpy(r.data, f.staging + sizeof(Header), r.bytes);
  }
  r.transfersLeft = 0;
}

void ProcessGroupTransport::poll(std::chrono::milliseconds timeout) {
  // Only collectives run here (ProcessGroupDdlcomm refuses send and recv over a carrier): each
  // waits for its own requests, and nothing else needs driving. gloo's send and recv Work do
  // not report completion before they are waited for, so there is nothing to notice either.
  std::this_thread::sleep_for(std::min(timeout, std::chrono::milliseconds(1)));
}

void ProcessGroupTransport::abort(ErrorKind kind, const std::string& reason) noexcept {
  if (broken_) return;
  brokenReason_ = failureMessage(kind, reason);
  brokenKind_ = kind;
  broken_ = true;
  for (auto& [request, f] : inFlight_) {
    request->failed = true;
    request->transfersLeft = 0;
  }
  inFlight_.clear();
}

void ProcessGroupTransport::throwIfBroken() const {
  if (broken_) throw Error(brokenKind_ == ErrorKind::Aborted ? ErrorKind::Aborted : brokenKind_, brokenReason_);
}

TransportStats ProcessGroupTransport::stats() const {
  TransportStats s;
  s.network = "c10d:" + carrier_->getBackendName();
  s.connectionsPerPeer.assign(size_t(size_), 1);
  s.connectionsPerPeer[size_t(rank_)] = 0;
  s.bytesSent = bytesSent_;
  return s;
}

}  // namespace ddlcomm::torch_glue
