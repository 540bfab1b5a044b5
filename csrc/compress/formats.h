// The table of compression formats: one row per format holds every fact about it that is not
// in its kernels. The payload layout (wire_format.h), the validation of headers, the bindings'
// Format enum and ddlcomm.compressors' classes all read it; the CPU and CUDA kernels are found
// through their own tables, one row per format in this order (compress/payload.cc,
// cuda/dispatch.cc), which check at compile time that they follow this one.
//
// Adding a compressor: a row here (its Format value is the payload's format byte, never reused),
// its kernels with a row in each kernel table, and a class in ddlcomm/compressors.py that names
// the row. A format of a new family also needs its layout in wire_format.h.
#pragma once

#include <cstddef>
#include <cstdint>

namespace ddlcomm::compress {

// The payload's format byte (wire_format.h).
enum class Format : uint8_t {
  OneBit = 1,
  Ternary = 2,
  TopK = 3,
  RandomK = 4,
  Float16 = 5,
  BFloat16 = 6,
};

// How a format lays out its payload (wire_format.h) and how the compressed collectives reduce it.
enum class Family : uint8_t {
  Blocks,  // float32 scales per block, then a few bits per element; reduced by re-encoding sums
  Sparse,  // (index, value) entries; reduced by all-gathering them
  Cast,    // every element in 16 bits; reduced by re-encoding sums
};

// Header flags (a payload may carry only its format's).
constexpr uint8_t kFlagTwoScales = 1;   // 1-bit: separate means for y >= 0 and y < 0
constexpr uint8_t kFlagStochastic = 2;  // ternary: stochastic rounding

struct FormatTraits {
  Format format;
  const char* name;       // "one_bit": inspect()'s and error messages' name; Python's enum in upper case
  Family family;
  unsigned codeBits;      // Blocks: bits of one element's code; 0 otherwise
  uint8_t flags;          // the header flags its payloads may carry
  bool valueCodes;        // Sparse: may send value codes (valueBits) instead of float32 values
  bool samplesRandomly;   // a random sample, which can miss a non-finite entry (the collectives check)
};

inline constexpr FormatTraits kFormats[] = {
    {Format::OneBit, "one_bit", Family::Blocks, 1, kFlagTwoScales, false, false},
    {Format::Ternary, "ternary", Family::Blocks, 2, kFlagStochastic, false, false},
    {Format::TopK, "top_k", Family::Sparse, 0, 0, true, false},
    {Format::RandomK, "random_k", Family::Sparse, 0, 0, false, true},
    {Format::Float16, "float16", Family::Cast, 0, 0, false, false},
    {Format::BFloat16, "bfloat16", Family::Cast, 0, 0, false, false},
};
constexpr size_t kFormatCount = sizeof(kFormats) / sizeof(kFormats[0]);

// The row of a format byte (from a payload or a caller), or null for an unknown one.
constexpr const FormatTraits* findFormat(uint8_t raw) {
  for (const FormatTraits& row : kFormats) {
    if (uint8_t(row.format) == raw) return &row;
  }
  return nullptr;
}
// Its index in kFormats (the kernel tables' index); kFormatCount for an unknown one.
constexpr size_t formatIndex(Format format) {
  const FormatTraits* row = findFormat(uint8_t(format));
  return row == nullptr ? kFormatCount : size_t(row - kFormats);
}

constexpr bool isKnownFormat(uint8_t raw) { return findFormat(raw) != nullptr; }
constexpr bool hasBlocks(Format format) {
  const FormatTraits* row = findFormat(uint8_t(format));
  return row != nullptr && row->family == Family::Blocks;
}
constexpr bool isSparse(Format format) {
  const FormatTraits* row = findFormat(uint8_t(format));
  return row != nullptr && row->family == Family::Sparse;
}
// "one_bit", "ternary", ...; "unknown" for a byte no row has.
constexpr const char* formatName(Format format) {
  const FormatTraits* row = findFormat(uint8_t(format));
  return row == nullptr ? "unknown" : row->name;
}
// Whether the format's payloads may carry the header flag (and its config the option behind it).
constexpr bool allowsFlag(Format format, uint8_t flag) {
  const FormatTraits* row = findFormat(uint8_t(format));
  return row != nullptr && (row->flags & flag) != 0;
}
// Blocks: bits of one element's code, and bytes of one block's float32 scales.
constexpr unsigned codeBits(Format format) {
  const FormatTraits* row = findFormat(uint8_t(format));
  return row == nullptr ? 0 : row->codeBits;
}
constexpr uint64_t blockScaleBytes(Format format, bool twoScales) {
  return twoScales && allowsFlag(format, kFlagTwoScales) ? 8 : 4;
}
constexpr bool takesValueCodes(Format format) {
  const FormatTraits* row = findFormat(uint8_t(format));
  return row != nullptr && row->valueCodes;
}

}  // namespace ddlcomm::compress
