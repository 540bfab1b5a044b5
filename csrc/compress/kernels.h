// Internal interface between the dispatcher (payload.cc), which validates arguments, lays
// out the payload sections and names each format's kernels in its table, and the per-format
// kernels. Section pointers may be unaligned. The block formats' kernels are block_codec.h's.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "compress/bits.h"
#include "compress/compress.h"
#include "compress/elements.h"

namespace ddlcomm::compress {

// Parallel parts of 1-bit and ternary start at multiples of this many blocks, so each part's
// codes start on a byte boundary.
constexpr size_t kBlocksPerUnit = 8;

// Ternary: throws Error(Protocol) on a code 3.
void checkTernaryCodes(const uint8_t* codes, size_t numel);

// Top-k (topk.cc) / random-k (randomk.cc): uint32 indices[k] ascending, then float32 values[k];
// decoded, summed and checked by sparse.cc.
void encodeTopK(const Config& config, const Input& in, uint64_t stream, size_t k, uint8_t* indices,
                uint8_t* values, TopKStats* stats);
void encodeRandomK(const Config& config, const Input& in, uint64_t stream, size_t k, uint8_t* indices,
                   uint8_t* values);
// Top-k's value codes (compress.h): from the k entries' values y (index order) and indices,
// writes the table and the valueBits-bit codes, and sets residual[index] = y - decoded.
void encodeValueCodes(size_t k, unsigned valueBits, const uint8_t* indices, const float* y, float* residual,
                      uint8_t* table, uint8_t* codes);

// The entries of one sparse payload: float32 values, or codes into a float32 table.
struct SparseSection {
  size_t k;
  const uint8_t* indices;
  const uint8_t* values;  // float32[k], or the table when valueBits > 0
  const uint8_t* codes;   // valueBits-bit codes; null for float32 values
  unsigned valueBits;

  // The sections of a payload laid out by `layout` (wire_format.h).
  static SparseSection of(const uint8_t* payload, const PayloadLayout& layout, size_t k, unsigned valueBits) {
    return {k, payload + layout.first, payload + layout.second, valueBits ? payload + layout.codes : nullptr,
            valueBits};
  }
  uint32_t index(size_t e) const { return loadLE<uint32_t>(indices + 4 * e); }
  float value(size_t e) const {
    if (valueBits == 0) return loadLE<float>(values + 4 * e);
    const size_t bit = e * valueBits;
    const unsigned code = (codes[bit / 8] >> (bit % 8)) & ((1u << valueBits) - 1);
    return loadLE<float>(values + 4 * code);
  }
};
void decodeSparse(size_t numel, const SparseSection& in, const Output& out);
// out[i] (outType) = (0 + the payloads' values at index i, in order) * factor, for each index i
// that some payload carries; the other elements of out are left alone.
void sumSections(const std::vector<SparseSection>& in, size_t numel, float factor, DataType outType, void* out);
// Throws Error(Protocol) unless the indices are strictly increasing and < numel.
void checkSparseIndices(const uint8_t* indices, size_t k, size_t numel);

// Float16 / BFloat16 casts (cast.cc): uint16 values[numel].
void encodeCast(Format format, const Input& in, uint8_t* values);
void decodeCast(Format format, size_t numel, const uint8_t* values, const Output& out);

// The cast kernels on the calling thread, for part of a vector (reduceEncode's fused pass in
// payload.cc): `in` / `out` hold elements [first, first + numel) of the vector, and the
// section pointers are the whole payload's.
void encodeCastRange(Format format, const Input& in, uint8_t* values);
void decodeCastRange(Format format, size_t first, size_t numel, const uint8_t* values, const Output& out);

}  // namespace ddlcomm::compress
