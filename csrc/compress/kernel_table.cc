// Each format's CPU kernels behind the signatures of CpuKernels (kernels.h): one row per row of
// kFormats (formats.h), in its order, so that payload.cc dispatches by table rather than by a
// switch per entry point.
#include <vector>

#include "common/error.h"
#include "compress/kernels.h"

namespace ddlcomm::compress {
namespace {

// The bits of the last byte of a packed section beyond the last element must be zero.
void checkUnusedBits(const uint8_t* section, size_t bytes, uint64_t numel, unsigned bitsPerElement,
                     const char* name) {
  const unsigned used = unsigned(numel % 8) * bitsPerElement % 8;
  if (bytes == 0 || used == 0) return;
  DDLCOMM_CHECK((section[bytes - 1] >> used) == 0, ErrorKind::Protocol, name,
                " payload: unused bits of the last byte are not zero");
}

// -- Blocks (1-bit, ternary) ----------------------------------------------------------------
void encodeBlocksPayload(const Config& config, const Input& in, uint64_t stream, uint64_t, const PayloadLayout& layout,
                         uint8_t* payload, TopKStats*) {
  encodeBlocks(config, in, stream, payload + layout.first, payload + layout.second);
}
void decodeBlocksPayload(const PayloadInfo& info, const PayloadLayout& layout, const uint8_t* payload,
                         const Output& out) {
  decodeBlocks(info.format, info.flags & kFlagTwoScales, size_t(info.numel), info.blockSize, payload + layout.first,
               payload + layout.second, out);
}
void checkBlockCodes(const PayloadInfo& info, const PayloadLayout& layout, const uint8_t* payload, const char* name) {
  checkUnusedBits(payload + layout.second, layout.secondBytes(), info.numel, codeBits(info.format), name);
  if (info.format == Format::Ternary) checkTernaryCodes(payload + layout.second, size_t(info.numel));
}
void decodeBlocksTile(const Config& config, size_t first, size_t numel, const PayloadLayout& layout,
                      const uint8_t* payload, const Output& out) {
  decodeBlocksRange(config.format, config.twoScales, first, numel, config.blockSize, payload + layout.first,
                    payload + layout.second, out);
}
void encodeBlocksTile(const Config& config, const Input& y, uint64_t stream, const PayloadLayout& layout,
                      uint8_t* payload) {
  encodeBlocksRange(config, y, stream, payload + layout.first, payload + layout.second);
}

// -- Sparse (top-k, random-k) ---------------------------------------------------------------
void encodeTopKPayload(const Config& config, const Input& in, uint64_t stream, uint64_t k, const PayloadLayout& layout,
                       uint8_t* payload, TopKStats* stats) {
  const unsigned valueBits = headerValueBits(config);
  if (valueBits == 0) {
    encodeTopK(config, in, stream, size_t(k), payload + layout.first, payload + layout.second, stats);
    return;
  }
  std::vector<float> y(static_cast<size_t>(k));  // the kept entries' values, then coded
  encodeTopK(config, in, stream, size_t(k), payload + layout.first, reinterpret_cast<uint8_t*>(y.data()), stats);
  encodeValueCodes(size_t(k), valueBits, payload + layout.first, y.data(), in.residual, payload + layout.second,
                   payload + layout.codes);
}
void encodeRandomKPayload(const Config& config, const Input& in, uint64_t stream, uint64_t k,
                          const PayloadLayout& layout, uint8_t* payload, TopKStats*) {
  encodeRandomK(config, in, stream, size_t(k), payload + layout.first, payload + layout.second);
}
void decodeSparsePayload(const PayloadInfo& info, const PayloadLayout& layout, const uint8_t* payload,
                         const Output& out) {
  decodeSparse(size_t(info.numel), SparseSection::of(payload, layout, size_t(info.k), info.valueBits), out);
}
void checkSparseEntries(const PayloadInfo& info, const PayloadLayout& layout, const uint8_t* payload,
                        const char* name) {
  checkSparseIndices(payload + layout.first, size_t(info.k), size_t(info.numel));
  if (info.valueBits != 0) {
    checkUnusedBits(payload + layout.codes, layout.bytes - layout.codes, info.k, info.valueBits, name);
  }
}

// -- Cast (float16, bfloat16) ---------------------------------------------------------------
void encodeCastPayload(const Config& config, const Input& in, uint64_t, uint64_t, const PayloadLayout& layout,
                       uint8_t* payload, TopKStats*) {
  encodeCast(config.format, in, payload + layout.first);
}
void decodeCastPayload(const PayloadInfo& info, const PayloadLayout& layout, const uint8_t* payload,
                       const Output& out) {
  decodeCast(info.format, size_t(info.numel), payload + layout.first, out);
}
// Every 16-bit pattern is a value.
void checkNothing(const PayloadInfo&, const PayloadLayout&, const uint8_t*, const char*) {}
void decodeCastTile(const Config& config, size_t first, size_t numel, const PayloadLayout& layout,
                    const uint8_t* payload, const Output& out) {
  decodeCastRange(config.format, first, numel, payload + layout.first, out);
}
void encodeCastTile(const Config& config, const Input& y, uint64_t, const PayloadLayout& layout, uint8_t* payload) {
  encodeCastRange(config.format, y, payload + layout.first);
}

constexpr CpuKernels kCpuKernels[] = {
    {Format::OneBit, encodeBlocksPayload, decodeBlocksPayload, checkBlockCodes, decodeBlocksTile, encodeBlocksTile},
    {Format::Ternary, encodeBlocksPayload, decodeBlocksPayload, checkBlockCodes, decodeBlocksTile, encodeBlocksTile},
    {Format::TopK, encodeTopKPayload, decodeSparsePayload, checkSparseEntries, nullptr, nullptr},
    {Format::RandomK, encodeRandomKPayload, decodeSparsePayload, checkSparseEntries, nullptr, nullptr},
    {Format::Float16, encodeCastPayload, decodeCastPayload, checkNothing, decodeCastTile, encodeCastTile},
    {Format::BFloat16, encodeCastPayload, decodeCastPayload, checkNothing, decodeCastTile, encodeCastTile},
};

constexpr bool followsFormats() {
  if (sizeof(kCpuKernels) / sizeof(kCpuKernels[0]) != kFormatCount) return false;
  for (size_t i = 0; i < kFormatCount; ++i) {
    const bool tiles = kFormats[i].family != Family::Sparse;
    if (kCpuKernels[i].format != kFormats[i].format || (kCpuKernels[i].encodeTile != nullptr) != tiles ||
        (kCpuKernels[i].decodeTile != nullptr) != tiles) {
      return false;
    }
  }
  return true;
}
static_assert(followsFormats(), "one row of CPU kernels per row of kFormats, in its order; tiles for every "
                                "format the compressed all-reduce re-encodes (not Sparse)");

}  // namespace

const CpuKernels& cpuKernels(Format format) {
  const size_t index = formatIndex(format);
  DDLCOMM_CHECK(index < kFormatCount, ErrorKind::InvalidArgument, "unknown compression format ", int(format));
  return kCpuKernels[index];
}

}  // namespace ddlcomm::compress
