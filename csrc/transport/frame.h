// The frame header that precedes every message between ranks. It carries the identity of
// the collective call (op, dtype, element count, sequence number, step) so a receiver can
// tell a mismatched call on the other side from a valid message, instead of reading
// garbage or hanging.
#pragma once

#include <cstdint>
#include <string>

#include "common/dtype.h"

namespace ddlcomm {

enum class OpCode : uint8_t {
  Allreduce = 1,
  Broadcast = 2,
  Reduce = 3,
  Allgather = 4,
  ReduceScatter = 5,
  AllToAll = 6,
  Barrier = 7,
  Gather = 8,
  Scatter = 9,
  PointToPoint = 10,  // send/recv: the signature's tag is the user's
};
const char* opCodeName(OpCode op);

// What a message claims to be. Sender and receiver compute it independently; the
// transport compares them when the message arrives.
struct Signature {
  OpCode op = OpCode::Allreduce;
  DataType dtype = DataType::UInt8;
  uint64_t tag = 0;    // what receives match on: the collective's sequence number in the group, or the send/recv tag
  uint32_t step = 0;   // message index within one collective between the same two ranks
  uint64_t count = 0;  // element count of the whole call, so size mismatches are named (0 for all_to_all)

  bool operator==(const Signature& o) const {
    return op == o.op && dtype == o.dtype && tag == o.tag && step == o.step && count == o.count;
  }
  bool operator!=(const Signature& o) const { return !(*this == o); }
  std::string describe() const;  // e.g. "allreduce #12 (float32 x 1024, step 3)"
};

constexpr uint32_t kFrameMagic = 0x444c4443;  // "CDLD" little endian
constexpr uint8_t kFrameVersion = 2;  // 2: the compressed collectives run as the ops above

#pragma pack(push, 1)
struct FrameHeader {
  uint32_t magic;
  uint8_t version;
  uint8_t op;
  uint8_t dtype;
  uint8_t stripe;  // index of this part when a message is split over several connections
  uint32_t step;
  uint32_t reserved;
  uint64_t tag;
  uint64_t count;
  uint64_t bytes;  // payload bytes that follow this header on the same connection
};
#pragma pack(pop)
static_assert(sizeof(FrameHeader) == 40, "frame header is part of the wire format");

FrameHeader makeFrameHeader(const Signature& sig, uint8_t stripe, uint64_t bytes);
// Validates magic, version, enum ranges and the reserved field; throws Error(Protocol) naming
// `peer`. The stripe index and bytes are the transport's to check against what it posted.
Signature parseFrameHeader(const FrameHeader& header, int peer);

}  // namespace ddlcomm
