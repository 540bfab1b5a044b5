// libFuzzer target: compressed payloads (csrc/compress/wire_format.h) as a hostile or corrupt
// peer could send them. Input: one control byte, then the payload bytes.
//   control bits 0-1: output dtype of decode (float32, float16, bfloat16, float32)
//   control bit 2:    the wrong element count tried is below the payload's (else above)
//   control bits 3-7: how far below or above
// Like compressed_allreduce.cc, a receiver checks the config (format, block size, value bits) it expects
// and sizes its output from the count it expects, never from the header. ddlcomm::Error is the
// expected way to refuse; a crash, a sanitizer report, any other exception, a timeout or a huge
// allocation (-malloc_limit_mb) is a finding.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "common/error.h"
#include "common/half.h"
#include "compress/compress.h"

using namespace ddlcomm;
using namespace ddlcomm::compress;

namespace {

// Largest header count given an output here: a sparse header may claim any count in 32 bytes
// (a receiver never sizes from the header; it passes its own count, tried below).
constexpr uint64_t kMaxNumel = uint64_t(1) << 16;

[[noreturn]] void finding(const char* what) {
  std::fprintf(stderr, "FINDING: %s\n", what);
  std::abort();
}

template <class Fn>
void mustThrow(const char* what, Fn&& fn) {
  try {
    fn();
  } catch (const Error&) {
    return;
  }
  finding(what);
}

// An output of exactly numel elements, so that ASan sees a write one past its end.
struct Output {
  std::vector<float> f32;
  std::vector<uint16_t> f16;
  Output(DataType type, size_t numel) {
    if (type == DataType::Float32) {
      f32.resize(numel);
    } else {
      f16.resize(numel);
    }
  }
  void* data() { return f32.empty() ? static_cast<void*>(f16.data()) : f32.data(); }
};

void decodeAs(const uint8_t* payload, size_t bytes, DataType type, size_t numel) {
  Output out(type, numel);
  decode(payload, bytes, type, out.data(), numel);
}

void accumulate(const uint8_t* payload, size_t bytes, size_t numel) {
  std::vector<float> out(numel);
  decodeAccumulate(payload, bytes, out.data(), numel);
}

bool sameValue(float a, float b) {
  uint32_t x, y;
  std::memcpy(&x, &a, 4);
  std::memcpy(&y, &b, 4);
  return x == y || (std::isnan(a) && std::isnan(b)) || (a == 0.f && b == 0.f);
}

// A payload inspect() accepts decodes at its own count, the same values every way.
void decodeValid(const uint8_t* payload, size_t bytes, DataType type, size_t numel) {
  std::vector<float> assigned(numel), summed(numel, 0.f);
  decode(payload, bytes, DataType::Float32, assigned.data(), numel);
  decodeAccumulate(payload, bytes, summed.data(), numel);
  for (size_t i = 0; i < numel; ++i) {
    if (!sameValue(assigned[i], summed[i])) finding("decode and decodeAccumulate disagree");
  }
  if (type == DataType::Float32) return;
  Output out(type, numel);
  decode(payload, bytes, type, out.data(), numel);
  for (size_t i = 0; i < numel; ++i) {
    const float v = assigned[i];
    if (out.f16[i] != (type == DataType::Float16 ? floatToFp16(v) : floatToBf16(v))) {
      finding("a 16-bit decode differs from the float32 decode rounded");
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const uint8_t control = data[0];
  const uint8_t* payload = data + 1;  // odd address: catches misaligned loads
  const size_t bytes = size - 1;
  constexpr DataType kTypes[] = {DataType::Float32, DataType::Float16, DataType::BFloat16, DataType::Float32};
  const DataType type = kTypes[control & 3];
  const uint64_t distance = 1 + (control >> 3);

  PayloadInfo info;
  try {
    info = inspect(payload, bytes);
  } catch (const Error& e) {
    if (e.kind() != ErrorKind::Protocol) finding("inspect threw a non-protocol error");
    // decode validates on its own: it must refuse what inspect refused.
    mustThrow("decode accepted a payload inspect refused", [&] { decodeAs(payload, bytes, type, distance); });
    mustThrow("decodeAccumulate accepted a payload inspect refused", [&] { accumulate(payload, bytes, distance); });
    return 0;
  }

  Config config;
  config.format = info.format;
  config.blockSize = info.blockSize;
  config.twoScales = info.flags & kFlagTwoScales;
  config.stochastic = info.flags & kFlagStochastic;
  config.valueBits = info.valueBits ? info.valueBits : 32;
  checkPayloadConfig(payload, bytes, config);
  if (info.format == Format::TopK) {  // value codes, or their width, are part of the compressor too
    Config other = config;
    other.valueBits = config.valueBits == 2 ? 4 : 2;
    mustThrow("checkPayloadConfig accepted other value bits", [&] { checkPayloadConfig(payload, bytes, other); });
  }
  // A flag that changes the encoding is part of the compressor a peer must match.
  if (info.format == Format::OneBit || info.format == Format::Ternary) {
    Config flipped = config;
    if (info.format == Format::OneBit) flipped.twoScales = !config.twoScales;
    else flipped.stochastic = !config.stochastic;
    mustThrow("checkPayloadConfig accepted another encoding flag", [&] { checkPayloadConfig(payload, bytes, flipped); });
  }
  config.format = Format(uint8_t(info.format) % 6 + 1);
  mustThrow("checkPayloadConfig accepted another format", [&] { checkPayloadConfig(payload, bytes, config); });

  if (info.numel <= kMaxNumel) decodeValid(payload, bytes, type, size_t(info.numel));

  // Any other count than the payload's is refused before a byte of the output is touched.
  uint64_t wrong = info.numel + distance;
  if (info.numel > kMaxNumel) {
    wrong = distance;
  } else if ((control & 4) && info.numel > 0) {
    wrong = info.numel - std::min(distance, info.numel);
  }
  mustThrow("decode accepted a wrong element count", [&] { decodeAs(payload, bytes, type, size_t(wrong)); });
  mustThrow("decodeAccumulate accepted a wrong element count", [&] { accumulate(payload, bytes, size_t(wrong)); });
  return 0;
}
