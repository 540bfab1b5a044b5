// kernels.h's entry points for the block formats: each format's multiversioned BlockCodec
// parts, threaded over the whole vector or run on part of it (reduceEncode's tiles).
#include "compress/block_codec.h"
#include "compress/kernels.h"
#include "compress/parallel.h"

namespace ddlcomm::compress {
namespace {

using EncodePart = void (*)(const BlockEncodeJob&, size_t, size_t);
using DecodePart = void (*)(const BlockDecodeJob&, size_t, size_t);

EncodePart encodePartOf(Format format) { return format == Format::OneBit ? encodeOneBitPart : encodeTernaryPart; }
DecodePart decodePartOf(Format format) { return format == Format::OneBit ? decodeOneBitPart : decodeTernaryPart; }

size_t blocksOf(size_t numel, size_t blockSize) { return (numel + blockSize - 1) / blockSize; }

}  // namespace

void encodeBlocks(const Config& config, const Input& in, uint64_t stream, uint8_t* scales, uint8_t* codes) {
  const EncodePart part = encodePartOf(config.format);
  const BlockEncodeJob job{config, in, stream, scales, codes};
  parallelFor(blocksOf(in.numel, config.blockSize), config.blockSize, kBlocksPerUnit,
              [&](size_t b0, size_t b1) { part(job, b0, b1); });
}

void decodeBlocks(Format format, bool twoScales, size_t numel, uint32_t blockSize, const uint8_t* scales,
                  const uint8_t* codes, const Output& out) {
  const DecodePart part = decodePartOf(format);
  const BlockDecodeJob job{numel, blockSize, twoScales, scales, codes, out};
  parallelFor(blocksOf(numel, blockSize), blockSize, kBlocksPerUnit, [&](size_t b0, size_t b1) { part(job, b0, b1); });
}

// `first` is a multiple of kBlocksPerUnit blocks, so both sections start on a byte there.
void encodeBlocksRange(const Config& config, const Input& in, uint64_t stream, uint8_t* scales, uint8_t* codes) {
  const size_t bs = config.blockSize;
  const BlockEncodeJob job{config, in, stream,
                           scales + in.first / bs * blockScaleBytes(config.format, config.twoScales),
                           codes + in.first * codeBits(config.format) / 8};
  encodePartOf(config.format)(job, 0, blocksOf(in.numel, bs));
}

void decodeBlocksRange(Format format, bool twoScales, size_t first, size_t numel, uint32_t blockSize,
                       const uint8_t* scales, const uint8_t* codes, const Output& out) {
  const BlockDecodeJob job{numel,
                           blockSize,
                           twoScales,
                           scales + first / blockSize * blockScaleBytes(format, twoScales),
                           codes + first * codeBits(format) / 8,
                           out};
  decodePartOf(format)(job, 0, blocksOf(numel, blockSize));
}

}  // namespace ddlcomm::compress
