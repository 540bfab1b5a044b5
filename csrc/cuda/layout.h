// Byte layout of a payload (compress/wire_format.h) computed from header fields alone, shared
// by the GPU encoders and decoders. Plain C++.
#pragma once

#include <cstddef>
#include <cstdint>

#include "compress/wire_format.h"

namespace ddlcomm::gpu {

struct PayloadLayout {
  uint64_t nblocks = 0;     // scale blocks (1-bit, ternary)
  uint64_t nscales = 0;     // float32 scales (2 per block for two-scale 1-bit)
  size_t scalesOffset = 0;  // 1-bit, ternary
  size_t dataOffset = 0;    // signs, codes, indices, or 16-bit values
  size_t valuesOffset = 0;  // top-k / random-k float32 values
  size_t dataBytes = 0;     // signs / codes bytes
  size_t bytes = 0;         // total payload size
};

inline PayloadLayout payloadLayout(compress::Format format, bool twoScales, uint32_t blockSize, uint64_t numel,
                                   uint64_t k) {
  constexpr size_t kHeader = sizeof(compress::PayloadHeader);
  PayloadLayout l;
  switch (format) {
    case compress::Format::OneBit:
    case compress::Format::Ternary: {
      const bool onebit = format == compress::Format::OneBit;
      l.nblocks = blockSize == 0 ? 0 : (numel + blockSize - 1) / blockSize;
      l.nscales = l.nblocks * (onebit && twoScales ? 2 : 1);
      l.scalesOffset = kHeader;
      l.dataOffset = kHeader + 4 * l.nscales;
      l.dataBytes = onebit ? (numel + 7) / 8 : (numel + 3) / 4;
      l.bytes = l.dataOffset + l.dataBytes;
      break;
    }
    case compress::Format::TopK:
    case compress::Format::RandomK:
      l.dataOffset = kHeader;
      l.valuesOffset = kHeader + 4 * k;
      l.bytes = kHeader + 8 * k;
      break;
    case compress::Format::Float16:
    case compress::Format::BFloat16:
      l.dataOffset = kHeader;
      l.bytes = kHeader + 2 * numel;
      break;
  }
  return l;
}

// The 32 header bytes as 8 little-endian words, handed to a kernel by value.
struct HeaderWords {
  uint32_t w[8];
};

inline HeaderWords makeHeader(compress::Format format, uint8_t flags, uint32_t blockSize, uint64_t numel,
                              uint64_t k) {
  HeaderWords h{};
  h.w[0] = compress::kPayloadMagic;
  h.w[1] = uint32_t(compress::kPayloadVersion) | (uint32_t(format) << 8) | (uint32_t(flags) << 16);
  h.w[2] = blockSize;
  h.w[3] = 0;
  h.w[4] = uint32_t(numel);
  h.w[5] = uint32_t(numel >> 32);
  h.w[6] = uint32_t(k);
  h.w[7] = uint32_t(k >> 32);
  return h;
}

}  // namespace ddlcomm::gpu
