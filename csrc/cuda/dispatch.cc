// Host entry points of cuda_kernels.h: argument checks, payload layout and header, dispatch to
// the per-format launchers. Plain C++ (no device code): it only enqueues work.
#include <cmath>
#include <cstdint>

#include "common/error.h"
#include "cuda/cuda_kernels.h"
#include "cuda/launchers.h"

namespace ddlcomm::gpu {
namespace {

void checkConfig(const compress::Config& c, size_t numel) {
  switch (c.format) {
    case compress::Format::OneBit:
    case compress::Format::Ternary:
      DDLCOMM_CHECK(c.blockSize >= 1, ErrorKind::InvalidArgument, "compression blockSize must be >= 1");
      DDLCOMM_CHECK(c.format != compress::Format::Ternary || (c.clip >= 0.f && std::isfinite(c.clip)),
                    ErrorKind::InvalidArgument, "ternary clip must be a finite value >= 0, got ", c.clip);
      DDLCOMM_CHECK(c.format != compress::Format::Ternary || c.stochastic || c.clip == 0.f,
                    ErrorKind::InvalidArgument, "clip applies to stochastic ternary only");
      break;
    case compress::Format::TopK:
    case compress::Format::RandomK:
      DDLCOMM_CHECK(numel <= compress::kMaxSparseNumel, ErrorKind::InvalidArgument,
                    "top-k / random-k payloads index with uint32: at most ", compress::kMaxSparseNumel,
                    " elements, got ", numel);
      DDLCOMM_CHECK(c.k > 0 || (c.ratio > 0.0 && c.ratio <= 1.0), ErrorKind::InvalidArgument,
                    "top-k / random-k ratio must be in (0, 1], got ", c.ratio);
      break;
    case compress::Format::Float16:
    case compress::Format::BFloat16: break;
    default: fail(ErrorKind::InvalidArgument, "unknown compression format ", int(c.format));
  }
  DDLCOMM_CHECK(compress::validValueBits(c), ErrorKind::InvalidArgument,
                "value_bits must be 32 (float32 values), or 1, 2, 4 or 8 for top-k; got ", c.valueBits);
}

void checkPayloadPointer(const void* payload, const char* what) {
  DDLCOMM_CHECK(payload != nullptr, ErrorKind::InvalidArgument, what, ": null payload");
  DDLCOMM_CHECK(reinterpret_cast<uintptr_t>(payload) % 4 == 0, ErrorKind::InvalidArgument, what,
                ": the payload must be 4-byte aligned (float32 scales and uint32 header words)");
}

// Decoding trusts the header fields in `info` (validated by compress::inspect on the host); the
// sizes derived from them must still match the buffer the caller hands in.
detail::DecodeArgs decodeArgs(const compress::PayloadInfo& info, const uint8_t* payload, size_t bytes,
                              DataType outType, void* out, size_t numel, bool accumulate, cudaStream_t s,
                              const char* what) {
  DDLCOMM_CHECK(outType == DataType::Float32 || outType == DataType::Float16 || outType == DataType::BFloat16,
                ErrorKind::UnsupportedType, what,
                ": output must be torch.float32, torch.float16 or torch.bfloat16, got ",
                dataTypeName(outType));
  DDLCOMM_CHECK(info.numel == numel, ErrorKind::InvalidArgument, what, ": the payload holds ", info.numel,
                " elements, the output has ", numel);
  DDLCOMM_CHECK(!compress::hasBlocks(info.format) || numel == 0 || info.blockSize >= 1, ErrorKind::Protocol, what,
                ": block size 0");
  DDLCOMM_CHECK(!compress::isSparse(info.format) || info.k <= numel, ErrorKind::Protocol, what, ": ", info.k,
                " entries for ", numel, " elements");
  DDLCOMM_CHECK(compress::isValueBits(info.valueBits) && (info.valueBits == 0 || info.format == compress::Format::TopK),
                ErrorKind::Protocol, what, ": invalid value bits ", info.valueBits);
  const bool two = info.format == compress::Format::OneBit && (info.flags & compress::kFlagTwoScales);
  const compress::PayloadLayout layout =
      compress::payloadLayout(info.format, two, info.blockSize, numel, info.k, info.valueBits);
  DDLCOMM_CHECK(bytes == layout.bytes, ErrorKind::Protocol, what, ": payload has ", bytes, " bytes, its header says ",
                layout.bytes);
  checkPayloadPointer(payload, what);
  DDLCOMM_CHECK(out != nullptr || numel == 0, ErrorKind::InvalidArgument, what, ": null output");
  return detail::DecodeArgs{info.format, two,    info.blockSize, numel, info.k,     info.valueBits,
                            payload,     layout, outType,        out,   accumulate, s};
}

void runDecode(const detail::DecodeArgs& a) {
  if (a.numel == 0) return;
  switch (a.format) {
    case compress::Format::OneBit: return detail::decodeOneBit(a);
    case compress::Format::Ternary: return detail::decodeTernary(a);
    case compress::Format::TopK:
    case compress::Format::RandomK: return detail::decodeSparse(a);
    case compress::Format::Float16:
    case compress::Format::BFloat16: return detail::decodeCast(a);
  }
  fail(ErrorKind::Protocol, "unknown payload format ", int(a.format));
}

}  // namespace

size_t encodedBytesCuda(const compress::Config& config, size_t numel) {
  checkConfig(config, numel);
  return compress::payloadLayout(config, numel).bytes;
}

size_t encodeWorkspaceBytes(const compress::Config& config, DataType, size_t numel) {
  checkConfig(config, numel);
  switch (config.format) {
    case compress::Format::TopK:
      return detail::topkWorkspaceBytes(config.approximate, numel, compress::keptEntries(config, numel),
                                        compress::headerValueBits(config));
    case compress::Format::RandomK: return detail::randomkWorkspaceBytes(numel, compress::keptEntries(config, numel));
    case compress::Format::Ternary: return detail::ternaryWorkspaceBytes(config, numel);
    default: return 0;
  }
}

size_t encodeCuda(const compress::Config& config, DataType xType, const void* x, float* residual, size_t numel,
                  uint64_t stream, uint8_t* payload, size_t capacity, void* workspace, size_t workspaceBytes,
                  cudaStream_t cudaStream) {
  checkConfig(config, numel);
  DDLCOMM_CHECK(xType == DataType::Float32 || xType == DataType::Float16 || xType == DataType::BFloat16,
                ErrorKind::UnsupportedType,
                "compression input must be torch.float32, torch.float16 or torch.bfloat16, got ",
                dataTypeName(xType));
  DDLCOMM_CHECK(x != nullptr || numel == 0, ErrorKind::InvalidArgument, "encodeCuda: null input");
  checkPayloadPointer(payload, "encodeCuda");
  const uint64_t k = compress::keptEntries(config, numel);
  const compress::PayloadLayout layout = compress::payloadLayout(config, numel);
  DDLCOMM_CHECK(capacity >= layout.bytes, ErrorKind::InvalidArgument, "encodeCuda: payload capacity ", capacity,
                " < ", layout.bytes, " bytes needed");
  const size_t needed = encodeWorkspaceBytes(config, xType, numel);
  DDLCOMM_CHECK(workspaceBytes >= needed && (needed == 0 || workspace != nullptr), ErrorKind::InvalidArgument,
                "encodeCuda: workspace of ", workspaceBytes, " bytes, ", needed, " needed");
  DDLCOMM_CHECK(reinterpret_cast<uintptr_t>(workspace) % 256 == 0, ErrorKind::InvalidArgument,
                "encodeCuda: the workspace must be 256-byte aligned");

  const HeaderWords header = headerWords(compress::makeHeader(config, numel));
  const detail::EncodeArgs a{config, xType,  x,      residual,  numel,          stream,
                             k,      payload, layout, header,   workspace, workspaceBytes, cudaStream};
  switch (config.format) {
    case compress::Format::OneBit: detail::encodeOneBit(a); break;
    case compress::Format::Ternary: detail::encodeTernary(a); break;
    case compress::Format::TopK: detail::encodeTopK(a); break;
    case compress::Format::RandomK: detail::encodeRandomK(a); break;
    case compress::Format::Float16:
    case compress::Format::BFloat16: detail::encodeCast(a); break;
  }
  return layout.bytes;
}

void decodeCuda(const compress::PayloadInfo& info, const uint8_t* payload, size_t bytes, DataType outType, void* out,
                size_t numel, cudaStream_t cudaStream) {
  runDecode(decodeArgs(info, payload, bytes, outType, out, numel, false, cudaStream, "decodeCuda"));
}

void decodeAccumulateCuda(const compress::PayloadInfo& info, const uint8_t* payload, size_t bytes, float* out,
                          size_t numel, cudaStream_t cudaStream) {
  runDecode(decodeArgs(info, payload, bytes, DataType::Float32, out, numel, true, cudaStream, "decodeAccumulateCuda"));
}

}  // namespace ddlcomm::gpu
