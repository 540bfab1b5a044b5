// libFuzzer target: the 40-byte frame header every message between ranks starts with
// (csrc/transport/frame.h). The first 40 bytes of the input are the header (zero padded).
// parseFrameHeader must throw Error(Protocol) or return a signature; a header it accepts
// must be exactly what makeFrameHeader writes, so no field reaches the transport unchecked.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "common/error.h"
#include "transport/frame.h"

using namespace ddlcomm;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FrameHeader header{};
  std::memcpy(&header, data, std::min(size, sizeof header));
  try {
    const Signature sig = parseFrameHeader(header, 1);
    (void)sig.describe();  // names op and dtype: must stay within their tables
    const FrameHeader again = makeFrameHeader(sig, header.stripe, header.bytes);
    if (std::memcmp(&again, &header, sizeof header) != 0) {
      std::fprintf(stderr, "FINDING: parseFrameHeader accepted a header makeFrameHeader does not write\n");
      std::abort();
    }
  } catch (const Error& e) {
    if (e.kind() != ErrorKind::Protocol) {
      std::fprintf(stderr, "FINDING: parseFrameHeader threw a non-protocol error: %s\n", e.what());
      std::abort();
    }
  }
  return 0;
}
