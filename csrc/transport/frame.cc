#include "transport/frame.h"

#include "common/error.h"

namespace ddlcomm {

const char* opCodeName(OpCode op) {
  switch (op) {
    case OpCode::Allreduce: return "allreduce";
    case OpCode::Broadcast: return "broadcast";
    case OpCode::Reduce: return "reduce";
    case OpCode::Allgather: return "allgather";
    case OpCode::ReduceScatter: return "reduce_scatter";
    case OpCode::AllToAll: return "all_to_all";
    case OpCode::Barrier: return "barrier";
    case OpCode::Gather: return "gather";
    case OpCode::Scatter: return "scatter";
    case OpCode::PointToPoint: return "send/recv";
  }
  return "unknown-op";
}

std::string Signature::describe() const {
  if (op == OpCode::PointToPoint) {
    return detail::concat("send/recv with tag ", tag, " (", dataTypeName(dtype), " x ", count, ")");
  }
  if (op == OpCode::AllToAll) {  // no count: totals differ between ranks (exchange.cc)
    return detail::concat(opCodeName(op), " #", tag, " (", dataTypeName(dtype), ", message ", step, ")");
  }
  return detail::concat(opCodeName(op), " #", tag, " (", dataTypeName(dtype), " x ", count, ", message ", step, ")");
}

FrameHeader makeFrameHeader(const Signature& sig, uint8_t stripe, uint64_t bytes) {
  FrameHeader h{};
  h.magic = kFrameMagic;
  h.version = kFrameVersion;
  h.op = uint8_t(sig.op);
  h.dtype = uint8_t(sig.dtype);
  h.stripe = stripe;
  h.step = sig.step;
  h.tag = sig.tag;
  h.count = sig.count;
  h.bytes = bytes;
  return h;
}

Signature parseFrameHeader(const FrameHeader& h, int peer) {
  if (h.magic != kFrameMagic) {
    fail(ErrorKind::Protocol, "corrupt frame from rank ", peer, ": bad magic 0x", std::hex, h.magic);
  }
  if (h.version != kFrameVersion) {
    fail(ErrorKind::Protocol, "rank ", peer, " speaks frame version ", int(h.version), ", this rank ",
         int(kFrameVersion), ": mixed ddlcomm versions in one job");
  }
  if (h.op < uint8_t(OpCode::Allreduce) || h.op > uint8_t(OpCode::PointToPoint) ||
      !isValidDataType(h.dtype)) {
    fail(ErrorKind::Protocol, "corrupt frame from rank ", peer, ": op ", int(h.op), ", dtype ", int(h.dtype));
  }
  // Always 0 as written by makeFrameHeader: a nonzero value is corruption, not a field to ignore.
  if (h.reserved != 0) {
    fail(ErrorKind::Protocol, "corrupt frame from rank ", peer, ": reserved field is 0x", std::hex, h.reserved);
  }
  Signature sig;
  sig.op = OpCode(h.op);
  sig.dtype = DataType(h.dtype);
  sig.tag = h.tag;
  sig.step = h.step;
  sig.count = h.count;
  return sig;
}

}  // namespace ddlcomm
