// A Transport over another c10d backend's point-to-point (gloo's, or a third party's): what
// lets a group of any backend run the compressed collectives on a ddlcomm executor, over
// ddlcomm's own collectives (ProcessGroupDdlcomm's carrier constructor; ddlcomm.compressed.engine_of). Like tcp/ and ucx/ it
// moves tagged messages; unlike them it adds no frame to each one: the first message of a
// call between two ranks carries the call's signature and its own size in front of its bytes,
// so a rank in another collective, with another count, dtype or split, fails with Mismatch
// instead of reading the wrong bytes.
//
// Tags: bit 30 set, the call's sequence number (15 bits) and the message's step (15 bits):
// user point-to-point on the same group, with tags below 2^30, never meets them. Driven by one
// thread (the executor), as every transport.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <array>
#include <map>
#include <string>
#include <vector>

#include "transport/transport.h"

namespace ddlcomm::torch_glue {

class ProcessGroupTransport final : public Transport {
 public:
  explicit ProcessGroupTransport(c10::intrusive_ptr<c10d::Backend> carrier);
  ~ProcessGroupTransport() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  void postSend(Request& request) override;
  void postRecv(Request& request) override;
  void wait(Request& request, Deadline deadline) override;
  void poll(std::chrono::milliseconds timeout) override;
  bool pollProgresses() const override { return false; }
  void wakeup() override {}
  void abort(ErrorKind kind, const std::string& reason) noexcept override;
  void throwIfBroken() const override;
  TransportStats stats() const override;

 private:
  // What the first message of a call to a peer carries in front of its bytes: a magic number,
  // op and dtype, the call's tag and count, the message's bytes.
  using Header = std::array<uint64_t, 5>;
  // This rank's header for `request` (what its peer's must equal).
  static Header headerOf(const Request& request);
  // A request's c10d Work; the first message of a call to a peer travels through `staging`
  // (the header, then the bytes), else null.
  struct InFlight {
    c10::intrusive_ptr<c10d::Work> work;
    uint8_t* staging = nullptr;
    bool isRecv = false;
  };
  // Posts the request's message (with the signature in front, the first of a call to a peer).
  void post(Request& request, bool isRecv);
  // Waits for one Work, up to `deadline`; a failure aborts the transport and throws.
  void waitWork(const c10::intrusive_ptr<c10d::Work>& work, const Request& request, Deadline deadline);
  // The staging buffer of the first message to (send) or from (receive) `peer`, of at least
  // `bytes`: one a direction per peer, kept, since a call has one such message each way and
  // the carrier may still hold one a failed call posted.
  std::vector<uint8_t>& stagingFor(int peer, bool isRecv, size_t bytes);
  // Throws Mismatch unless the peer's header (received) is this request's.
  void checkSignature(const Request& request, const Header& theirs);

  c10::intrusive_ptr<c10d::Backend> carrier_;
  const int rank_;
  const int size_;
  std::map<Request*, InFlight> inFlight_;
  std::vector<std::vector<uint8_t>> staging_;  // by peer: [2 * peer] sends, [2 * peer + 1] receives
  bool broken_ = false;
  ErrorKind brokenKind_ = ErrorKind::Aborted;
  std::string brokenReason_;
  uint64_t bytesSent_ = 0;
};

}  // namespace ddlcomm::torch_glue
