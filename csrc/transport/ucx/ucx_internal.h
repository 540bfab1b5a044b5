// Shared by the UCX transport's files: the tag layout, and helpers the connection set-up
// and the data path both use.
#pragma once

#include <ucp/api/ucp.h>

#include <cstddef>
#include <cstdint>
#include <string>

namespace ddlcomm::ucx::internal {

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

inline ucp_tag_t makeTag(TagKind kind, int source, uint64_t low) {
  return (ucp_tag_t(kind) << kKindShift) | (ucp_tag_t(source) << kSourceShift) | (low & kLowMask);
}
inline int tagSource(ucp_tag_t tag) { return int((tag & kSourceMask) >> kSourceShift); }

// Field 22 (start time) of /proc/<pid>/stat, or "" once the process is gone or a zombie.
std::string processStartTime(const std::string& pid);

// Throws Error(System) naming `what` unless `status` is UCS_OK.
void check(ucs_status_t status, const char* what);

// Silences UCX's own logging for its lifetime, where UCX reports as errors what this
// transport expects and handles (an endpoint with peer failure handling to a peer only
// shared memory reaches; teardown after a failure).
class QuietUcxLog {
 public:
  QuietUcxLog();
  ~QuietUcxLog();
  QuietUcxLog(const QuietUcxLog&) = delete;
  QuietUcxLog& operator=(const QuietUcxLog&) = delete;
};

}  // namespace ddlcomm::ucx::internal
