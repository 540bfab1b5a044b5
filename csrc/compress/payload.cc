// The public entry points of compress.h: argument checks, payload layout (wire_format.h),
// header writing and complete validation, and dispatch through one table, kCpuKernels, whose
// row for each format names its kernels (onebit.cc, ternary.cc, topk.cc, randomk.cc, sparse.cc,
// cast.cc), as csrc/cuda/dispatch.cc's does for the CUDA ones.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "common/error.h"
#include "compress/bits.h"
#include "compress/block_codec.h"
#include "compress/compress.h"
#include "compress/kernels.h"
#include "compress/parallel.h"

namespace ddlcomm::compress {
namespace {

// ---- The kernels: one row of kCpuKernels per row of kFormats (formats.h), in its order ------

// One format's CPU kernels, behind one signature per entry point: a row of kCpuKernels.
struct CpuKernels {
  Format format;
  // Writes the payload's sections (its header is written) for the k entries kept (Sparse).
  void (*encode)(const Config& config, const Input& in, uint64_t stream, uint64_t k, const PayloadLayout& layout,
                 uint8_t* payload, TopKStats* stats);
  void (*decode)(const PayloadInfo& info, const PayloadLayout& layout, const uint8_t* payload, const Output& out);
  // inspect(): the sections' contents (codes, index order, unused bits), after the header;
  // throws Error(Protocol) naming the payload `name`.
  void (*check)(const PayloadInfo& info, const PayloadLayout& layout, const uint8_t* payload, const char* name);
  // reduceEncode, tile by tile: decode elements [first, first + numel) of a payload, and encode
  // y into the same elements of another. Null for Sparse formats (sumSparse sums them).
  void (*decodeTile)(const Config& config, size_t first, size_t numel, const PayloadLayout& layout,
                     const uint8_t* payload, const Output& out);
  void (*encodeTile)(const Config& config, const Input& y, uint64_t stream, const PayloadLayout& layout,
                     uint8_t* payload);
};

// The bits of the last byte of a packed section beyond the last element must be zero.
void checkUnusedBits(const uint8_t* section, size_t bytes, uint64_t numel, unsigned bitsPerElement,
                     const char* name) {
  const unsigned used = unsigned(numel % 8) * bitsPerElement % 8;
  if (bytes == 0 || used == 0) return;
  DDLCOMM_CHECK((section[bytes - 1] >> used) == 0, ErrorKind::Protocol, name,
                " payload: unused bits of the last byte are not zero");
}

// -- Blocks (1-bit, ternary): each format's multiversioned BlockCodec parts (block_codec.h),
// threaded over the whole vector, or run on one tile of it --------------------------------
using EncodePart = void (*)(const BlockEncodeJob&, size_t, size_t);
using DecodePart = void (*)(const BlockDecodeJob&, size_t, size_t);

size_t blocksOf(size_t numel, size_t blockSize) { return (numel + blockSize - 1) / blockSize; }

template <EncodePart Part>
void encodeBlocksPayload(const Config& config, const Input& in, uint64_t stream, uint64_t, const PayloadLayout& layout,
                         uint8_t* payload, TopKStats*) {
  const BlockEncodeJob job{config, in, stream, payload + layout.first, payload + layout.second};
  parallelFor(blocksOf(in.numel, config.blockSize), config.blockSize, kBlocksPerUnit,
              [&](size_t b0, size_t b1) { Part(job, b0, b1); });
}
template <DecodePart Part>
void decodeBlocksPayload(const PayloadInfo& info, const PayloadLayout& layout, const uint8_t* payload,
                         const Output& out) {
  const BlockDecodeJob job{size_t(info.numel), info.blockSize, (info.flags & kFlagTwoScales) != 0,
                           payload + layout.first, payload + layout.second, out};
  parallelFor(blocksOf(job.numel, job.blockSize), job.blockSize, kBlocksPerUnit,
              [&](size_t b0, size_t b1) { Part(job, b0, b1); });
}
// The codes' unused bits are zero; a ternary code is never 3.
template <bool Ternary>
void checkBlockCodes(const PayloadInfo& info, const PayloadLayout& layout, const uint8_t* payload, const char* name) {
  checkUnusedBits(payload + layout.second, layout.secondBytes(), info.numel, codeBits(info.format), name);
  if constexpr (Ternary) checkTernaryCodes(payload + layout.second, size_t(info.numel));
}
// A tile starts at a multiple of kBlocksPerUnit blocks, so both its sections start on a byte.
template <DecodePart Part>
void decodeBlocksTile(const Config& config, size_t first, size_t numel, const PayloadLayout& layout,
                      const uint8_t* payload, const Output& out) {
  const size_t bs = config.blockSize;
  const BlockDecodeJob job{numel, config.blockSize, config.twoScales,
                           payload + layout.first + first / bs * blockScaleBytes(config.format, config.twoScales),
                           payload + layout.second + first * codeBits(config.format) / 8, out};
  Part(job, 0, blocksOf(numel, bs));
}
template <EncodePart Part>
void encodeBlocksTile(const Config& config, const Input& y, uint64_t stream, const PayloadLayout& layout,
                      uint8_t* payload) {
  const size_t bs = config.blockSize;
  const BlockEncodeJob job{config, y, stream,
                           payload + layout.first + y.first / bs * blockScaleBytes(config.format, config.twoScales),
                           payload + layout.second + y.first * codeBits(config.format) / 8};
  Part(job, 0, blocksOf(y.numel, bs));
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
    {Format::OneBit, encodeBlocksPayload<encodeOneBitPart>, decodeBlocksPayload<decodeOneBitPart>,
     checkBlockCodes<false>, decodeBlocksTile<decodeOneBitPart>, encodeBlocksTile<encodeOneBitPart>},
    {Format::Ternary, encodeBlocksPayload<encodeTernaryPart>, decodeBlocksPayload<decodeTernaryPart>,
     checkBlockCodes<true>, decodeBlocksTile<decodeTernaryPart>, encodeBlocksTile<encodeTernaryPart>},
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

// The row of a format (Error(InvalidArgument) for an unknown one).
const CpuKernels& cpuKernels(Format format) {
  const size_t index = formatIndex(format);
  DDLCOMM_CHECK(index < kFormatCount, ErrorKind::InvalidArgument, "unknown compression format ", int(format));
  return kCpuKernels[index];
}

// Elements reduced and re-encoded at a time by reduceEncode: small enough to stay in L1/L2.
constexpr size_t kReduceTileElements = 8192;
// Float32 decode outputs from this size on bypass the cache (Output::streaming).
constexpr size_t kStreamingBytes = size_t(4) << 20;

void checkConfig(const Config& config) {
  DDLCOMM_CHECK(isKnownFormat(uint8_t(config.format)), ErrorKind::InvalidArgument, "unknown compression format ",
                int(config.format));
  if (hasBlocks(config.format)) {
    DDLCOMM_CHECK(config.blockSize > 0, ErrorKind::InvalidArgument, "block size must be positive");
  }
  if (allowsFlag(config.format, kFlagStochastic)) {
    DDLCOMM_CHECK(std::isfinite(config.clip) && config.clip >= 0.f, ErrorKind::InvalidArgument,
                  "clip must be a finite number >= 0, got ", config.clip);
    DDLCOMM_CHECK(config.stochastic || config.clip == 0.f, ErrorKind::InvalidArgument,
                  "clip applies to stochastic ternary only");
  }
  DDLCOMM_CHECK(validValueBits(config), ErrorKind::InvalidArgument,
                "value_bits must be 32 (float32 values), or 1, 2, 4 or 8 for top-k; got ", config.valueBits, " for ",
                formatName(config.format));
  if (isSparse(config.format) && config.k == 0) {
    DDLCOMM_CHECK(config.ratio > 0.0 && config.ratio <= 1.0, ErrorKind::InvalidArgument,
                  "ratio must be in (0, 1], got ", config.ratio);
  }
}

PayloadLayout layoutFor(const Config& config, size_t numel) {
  checkConfig(config);
  const PayloadLayout layout = payloadLayout(config, numel);
  DDLCOMM_CHECK(layout.fits, ErrorKind::InvalidArgument, "a payload for ", numel, " elements would not fit in memory");
  return layout;
}

// "one_bit (block size 256, flags 0)", "top_k (block size 0, flags 0, 2-bit values)", for
// mismatch messages.
std::string describeHeader(uint8_t format, uint32_t blockSize, uint8_t flags, uint32_t valueBits) {
  return detail::concat(isKnownFormat(format) ? formatName(Format(format)) : "an unknown format", " (block size ",
                        blockSize, ", flags ", int(flags),
                        valueBits ? detail::concat(", ", valueBits, "-bit values") : std::string(), ")");
}

void writeHeader(const Config& config, uint64_t numel, uint8_t* payload) {
  const PayloadHeader header = makeHeader(config, numel);
  std::memcpy(payload, &header, kHeaderBytes);
}

void decodeInto(const uint8_t* payload, size_t bytes, const Output& out, size_t numel) {
  const PayloadInfo info = inspect(payload, bytes);
  DDLCOMM_CHECK(info.numel == numel, ErrorKind::InvalidArgument, "the payload holds ", info.numel,
                " elements, the output has ", numel);
  DDLCOMM_CHECK(numel == 0 || out.data != nullptr, ErrorKind::InvalidArgument, "decode: null output");
  const PayloadLayout layout =
      payloadLayout(info.format, info.flags & kFlagTwoScales, info.blockSize, info.numel, info.k, info.valueBits);
  cpuKernels(info.format).decode(info, layout, payload, out);
}

}  // namespace

void checkFloatType(DataType type, const char* what) {
  DDLCOMM_CHECK(type == DataType::Float32 || type == DataType::Float16 || type == DataType::BFloat16,
                ErrorKind::UnsupportedType, what, " must be torch.float32, torch.float16 or torch.bfloat16, got ",
                dataTypeName(type));
}

size_t encodedBytes(const Config& config, size_t numel) { return layoutFor(config, numel).bytes; }

size_t encode(const Config& config, DataType xType, const void* x, float* residual, size_t numel, uint64_t stream,
              uint8_t* payload, size_t capacity, TopKStats* topKStats) {
  const PayloadLayout layout = layoutFor(config, numel);
  checkFloatType(xType, "the input");
  DDLCOMM_CHECK(capacity >= layout.bytes, ErrorKind::InvalidArgument, "payload buffer of ", capacity,
                " bytes is too small, the payload needs ", layout.bytes);
  DDLCOMM_CHECK(numel == 0 || x != nullptr, ErrorKind::InvalidArgument, "encode: null input");
  if (isSparse(config.format)) {
    DDLCOMM_CHECK(numel <= kMaxSparseNumel, ErrorKind::InvalidArgument,
                  "top-k / random-k payloads index with uint32: at most ", kMaxSparseNumel, " elements, got ", numel);
  }
  const uint64_t k = keptEntries(config, numel);
  writeHeader(config, numel, payload);

  cpuKernels(config.format).encode(config, Input{xType, x, residual, numel}, stream, k, layout, payload, topKStats);
  return layout.bytes;
}

PayloadInfo inspect(const uint8_t* payload, size_t bytes) {
  DDLCOMM_CHECK(payload != nullptr || bytes == 0, ErrorKind::InvalidArgument, "inspect: null payload");
  DDLCOMM_CHECK(bytes >= kHeaderBytes, ErrorKind::Protocol, "payload of ", bytes, " bytes is shorter than its ",
                kHeaderBytes, "-byte header");
  PayloadHeader h;
  std::memcpy(&h, payload, kHeaderBytes);
  DDLCOMM_CHECK(h.magic == kPayloadMagic, ErrorKind::Protocol, "not a ddlcomm payload (bad magic)");
  DDLCOMM_CHECK(h.version == kPayloadVersion, ErrorKind::Protocol, "payload version ", int(h.version),
                " is not supported (expected ", int(kPayloadVersion), ")");
  DDLCOMM_CHECK(isKnownFormat(h.format), ErrorKind::Protocol, "unknown payload format ", int(h.format));
  const auto format = Format(h.format);
  const FormatTraits& row = *findFormat(h.format);
  const char* name = row.name;
  DDLCOMM_CHECK(h.reserved0 == 0, ErrorKind::Protocol, name, " payload: the reserved header byte is not zero");
  DDLCOMM_CHECK((h.flags & ~row.flags) == 0, ErrorKind::Protocol, name, " payload: invalid flags ", int(h.flags));
  if (row.family == Family::Blocks) {
    DDLCOMM_CHECK(h.blockSize > 0, ErrorKind::Protocol, name, " payload: block size is 0");
  } else {
    DDLCOMM_CHECK(h.blockSize == 0, ErrorKind::Protocol, name, " payload: block size must be 0, got ", h.blockSize);
  }
  DDLCOMM_CHECK(h.valueBits == 0 || (row.valueCodes && isValueBits(h.valueBits)), ErrorKind::Protocol,
                name, " payload: invalid value bits ", h.valueBits);
  if (row.family == Family::Sparse) {
    DDLCOMM_CHECK(h.k <= h.numel, ErrorKind::Protocol, name, " payload: k = ", h.k, " exceeds numel = ", h.numel);
  } else {
    DDLCOMM_CHECK(h.k == 0, ErrorKind::Protocol, name, " payload: k must be 0, got ", h.k);
  }
  const PayloadLayout layout = payloadLayout(format, h.flags & kFlagTwoScales, h.blockSize, h.numel, h.k, h.valueBits);
  DDLCOMM_CHECK(layout.fits, ErrorKind::Protocol, name, " payload: header sizes overflow (numel ", h.numel, ", k ",
                h.k, ")");
  DDLCOMM_CHECK(bytes == layout.bytes, ErrorKind::Protocol, name, " payload has ", bytes, " bytes, its header (numel ",
                h.numel, ", k ", h.k, ", block size ", h.blockSize, ") needs ", layout.bytes);

  const PayloadInfo info{format, h.flags, h.blockSize, h.numel, h.k, h.valueBits};
  cpuKernels(format).check(info, layout, payload, name);
  return info;
}

void checkPayloadConfig(const uint8_t* payload, size_t bytes, const Config& config) {
  DDLCOMM_CHECK(payload != nullptr && bytes >= kHeaderBytes, ErrorKind::Protocol, "payload of ", bytes,
                " bytes is shorter than its ", kHeaderBytes, "-byte header");
  PayloadHeader h;
  std::memcpy(&h, payload, kHeaderBytes);
  const uint8_t flags = headerFlags(config);
  const uint32_t blockSize = headerBlockSize(config);
  const uint32_t valueBits = headerValueBits(config);
  DDLCOMM_CHECK(h.format == uint8_t(config.format) && h.flags == flags && h.blockSize == blockSize &&
                    h.valueBits == valueBits,
                ErrorKind::Mismatch, "the payload is ", describeHeader(h.format, h.blockSize, h.flags, h.valueBits),
                ", this rank expects ", describeHeader(uint8_t(config.format), blockSize, flags, valueBits),
                ": every rank must use the same compressor");
}

void decode(const uint8_t* payload, size_t bytes, DataType outType, void* out, size_t numel) {
  checkFloatType(outType, "the output");
  decodeInto(payload, bytes, Output{outType, out, false, numel * sizeof(float) >= kStreamingBytes}, numel);
}

void decodeAccumulate(const uint8_t* payload, size_t bytes, float* out, size_t numel) {
  decodeInto(payload, bytes, Output{DataType::Float32, out, true}, numel);
}

namespace {

// A payload from another rank, about to be summed: made with this config, valid, numel long.
PayloadInfo checkSummand(const Config& config, const uint8_t* payload, size_t bytes, size_t numel) {
  checkPayloadConfig(payload, bytes, config);
  const PayloadInfo info = inspect(payload, bytes);
  DDLCOMM_CHECK(info.numel == numel, ErrorKind::Protocol, "payload of ", info.numel, " elements where ", numel,
                " were expected");
  return info;
}

}  // namespace

size_t reduceEncode(const Config& config, const uint8_t* const* payloads, size_t count, size_t payloadBytes,
                    size_t numel, float factor, float* residual, uint64_t stream, uint8_t* out, size_t capacity) {
  const PayloadLayout layout = layoutFor(config, numel);
  DDLCOMM_CHECK(!isSparse(config.format), ErrorKind::InvalidArgument, "reduceEncode: ", formatName(config.format),
                " payloads are summed sparsely, not re-encoded");
  DDLCOMM_CHECK(capacity >= layout.bytes, ErrorKind::InvalidArgument, "payload buffer of ", capacity,
                " bytes is too small, the payload needs ", layout.bytes);
  for (size_t j = 0; j < count; ++j) checkSummand(config, payloads[j], payloadBytes, numel);
  writeHeader(config, numel, out);
  const CpuKernels& kernels = cpuKernels(config.format);

  const size_t unit = hasBlocks(config.format) ? kBlocksPerUnit * config.blockSize : 64;
  const size_t tile = unit * std::max<size_t>(1, kReduceTileElements / unit);
  parallelFor((numel + tile - 1) / tile, tile, 1, [&](size_t t0, size_t t1) {
    std::vector<float> sum(std::min(tile, numel));
    const Output accumulate{DataType::Float32, sum.data(), true};
    for (size_t t = t0; t < t1; ++t) {
      const size_t begin = t * tile, len = std::min(tile, numel - begin);
      std::fill(sum.begin(), sum.begin() + ptrdiff_t(len), 0.f);
      for (size_t j = 0; j < count; ++j) kernels.decodeTile(config, begin, len, layout, payloads[j], accumulate);
      if (factor != 1.f) {
        for (size_t i = 0; i < len; ++i) sum[i] *= factor;
      }
      const Input y{DataType::Float32, sum.data(), residual ? residual + begin : nullptr, len, begin};
      kernels.encodeTile(config, y, stream, layout, out);
    }
  });
  return layout.bytes;
}

void sumSparse(const Config& config, const uint8_t* const* payloads, size_t count, size_t payloadBytes, size_t numel,
               float factor, DataType outType, void* out) {
  checkConfig(config);
  DDLCOMM_CHECK(isSparse(config.format), ErrorKind::InvalidArgument, "sumSparse: ", formatName(config.format),
                " payloads are not sparse");
  checkFloatType(outType, "the output");
  DDLCOMM_CHECK(numel == 0 || out != nullptr, ErrorKind::InvalidArgument, "sumSparse: null output");
  std::vector<SparseSection> sections;
  for (size_t j = 0; j < count; ++j) {
    const PayloadInfo info = checkSummand(config, payloads[j], payloadBytes, numel);
    const PayloadLayout layout = payloadLayout(info.format, false, 0, info.numel, info.k, info.valueBits);
    sections.push_back(SparseSection::of(payloads[j], layout, size_t(info.k), info.valueBits));
  }
  sumSections(sections, numel, factor, outType, out);
}

}  // namespace ddlcomm::compress
