// The one definition of every compressed payload: a fixed header, then sections whose
// sizes follow from the header alone. Encoders on the CPU (csrc/compress) and the GPU
// (csrc/cuda) write exactly these bytes; decoders validate them before touching memory.
//
//   offset  size  field
//   0       4     magic 'DDLZ' (0x5a4c4444 little endian)
//   4       1     version (1)
//   5       1     format (Format)
//   6       1     flags (kFlagTwoScales: 1-bit with separate means for >= 0 and < 0;
//                 kFlagStochastic: ternary by stochastic rounding; decoding ignores both)
//   7       1     reserved (0)
//   8       4     blockSize: elements per scale block (1-bit, ternary); 0 otherwise
//   12      4     valueBits: bits per top-k value code (1, 2, 4 or 8); 0 for float32 values
//                 and for every other format
//   16      8     numel: elements of the original vector
//   24      8     k: entries carried (top-k, random-k); 0 otherwise
//   32      ...   sections, in this order:
//     OneBit   float32 scales[nblocks * (twoScales ? 2 : 1)] (for two scales: [pos, neg] per block),
//              then sign bits[ceil(numel / 8)]: bit (i % 8) of byte i / 8 is 1 when x_i >= 0
//     Ternary  float32 scales[nblocks], then 2-bit codes[ceil(numel / 4)]: code of x_i in bits
//              2*(i % 4) .. 2*(i % 4)+1 of byte i / 4; 0 -> 0, 1 -> +s, 2 -> -s, 3 is invalid
//     TopK,    uint32 indices[k], strictly increasing, < numel; then float32 values[k]
//     RandomK
//     TopK     (valueBits b > 0) uint32 indices[k] as above; then float32 table[2^b]; then
//              b-bit codes[ceil(k * b / 8)]: code of entry e in bits b*(e % (8/b)) .. of byte
//              e*b/8; entry e decodes to table[code]
//     Float16  uint16 values[numel] (IEEE half / bfloat16 bits)
//     BFloat16
// nblocks = ceil(numel / blockSize). All integers little endian. Unused bits are zero.
#pragma once

#include <cstddef>
#include <cstdint>

#include "compress/formats.h"

namespace ddlcomm::compress {

constexpr uint32_t kPayloadMagic = 0x5a4c4444;  // "DDLZ"
constexpr uint8_t kPayloadVersion = 1;
// Top-k / random-k index with uint32: at most this many elements, so that every index and the
// element count itself fit in 32 bits (CPU and CUDA check the same bound).
constexpr uint64_t kMaxSparseNumel = 0xffffffffull;

#pragma pack(push, 1)
struct PayloadHeader {
  uint32_t magic;
  uint8_t version;
  uint8_t format;
  uint8_t flags;
  uint8_t reserved0;
  uint32_t blockSize;
  uint32_t valueBits;
  uint64_t numel;
  uint64_t k;
};
#pragma pack(pop)
static_assert(sizeof(PayloadHeader) == 32, "payload header is part of the wire format");
constexpr uint64_t kHeaderBytes = sizeof(PayloadHeader);

// Top-k value codes: the widths a payload may carry (0: float32 values).
constexpr bool isValueBits(uint64_t bits) { return bits == 0 || bits == 1 || bits == 2 || bits == 4 || bits == 8; }
constexpr uint64_t valueTableBytes(unsigned valueBits) { return valueBits == 0 ? 0 : uint64_t(4) << valueBits; }

// Where the sections above lie, from the header fields alone: the one computation of payload
// sizes for the CPU (payload.cc) and the CUDA host code. Plain C++, usable by either build.
struct PayloadLayout {
  uint64_t nblocks = 0;  // scale blocks (1-bit, ternary)
  uint64_t first = 0;    // offset of the first section: scales, indices, or the 16-bit values
  uint64_t second = 0;   // offset of the second: sign bits, codes, float32 values or the value
                         // table (casts: = bytes)
  uint64_t codes = 0;    // top-k with value codes: offset of the codes (after the table); else 0
  uint64_t bytes = 0;    // the whole payload
  bool fits = false;     // false when a size overflows size_t: then nothing else is meaningful

  uint64_t firstBytes() const { return second - first; }
  uint64_t secondBytes() const { return bytes - second; }
};

// blockSize 0 gives no blocks (only reached for an empty vector: decoders check the rest).
// valueBits: top-k's value codes (0: float32 values; checked by the caller).
inline PayloadLayout payloadLayout(Format format, bool twoScales, uint64_t blockSize, uint64_t numel, uint64_t k,
                                   unsigned valueBits) {
  bool fits = true;
  auto times = [&](uint64_t a, uint64_t b) {  // a * b, noting an overflow
    fits = fits && (a == 0 || b <= SIZE_MAX / a);
    return a * b;
  };
  auto plus = [&](uint64_t a, uint64_t b) {
    fits = fits && b <= SIZE_MAX - a;
    return a + b;
  };
  auto ceilDiv = [](uint64_t a, uint64_t b) { return a / b + (a % b != 0); };
  PayloadLayout l;
  l.first = kHeaderBytes;
  uint64_t firstBytes = 0, secondBytes = 0;
  const FormatTraits* row = findFormat(uint8_t(format));
  if (row == nullptr) return l;  // fits = false: an unknown format has no layout
  switch (row->family) {
    case Family::Blocks:
      l.nblocks = blockSize == 0 ? 0 : ceilDiv(numel, blockSize);
      firstBytes = times(l.nblocks, blockScaleBytes(format, twoScales));
      secondBytes = ceilDiv(numel, 8 / row->codeBits);
      break;
    case Family::Sparse:
      firstBytes = times(k, 4);
      secondBytes = valueBits == 0 ? firstBytes : plus(valueTableBytes(valueBits), ceilDiv(times(k, valueBits), 8));
      break;
    case Family::Cast:
      firstBytes = times(numel, 2);
      break;
  }
  l.second = plus(l.first, firstBytes);
  l.bytes = plus(l.second, secondBytes);
  if (valueBits != 0 && row->family == Family::Sparse) l.codes = l.second + valueTableBytes(valueBits);
  l.fits = fits;
  return l;
}

}  // namespace ddlcomm::compress
