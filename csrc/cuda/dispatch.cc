// Host entry points of cuda_kernels.h: argument checks, payload layout and header, dispatch to
// the per-format launchers. Plain C++ (no device code): it only enqueues work.
#include <cmath>
#include <cstdint>
#include <vector>

#include "common/error.h"
#include "cuda/cuda_kernels.h"
#include "cuda/launchers.h"

namespace ddlcomm::gpu {
namespace {

// Each format's kernels (launchers.h), one row per row of compress::kFormats, in its order.
struct CudaKernels {
  compress::Format format;
  void (*encode)(const detail::EncodeArgs* a, size_t n);
  void (*decode)(const detail::DecodeArgs* a, size_t n);
  void (*sum)(const detail::DecodeArgs* a, size_t n, float scale, float* out);  // null: summed sparsely
  size_t (*workspaceBytes)(const compress::Config& config, uint64_t numel);   // scratch of an encode
};

// The formats whose kernels take one chunk a launch.
template <void (*One)(const detail::EncodeArgs&)>
void eachEncode(const detail::EncodeArgs* a, size_t n) {
  for (size_t i = 0; i < n; ++i) One(a[i]);
}
template <void (*One)(const detail::DecodeArgs&)>
void eachDecode(const detail::DecodeArgs* a, size_t n) {
  for (size_t i = 0; i < n; ++i) One(a[i]);
}

size_t noWorkspace(const compress::Config&, uint64_t) { return 0; }
size_t ternaryWorkspace(const compress::Config& c, uint64_t numel) { return detail::ternaryWorkspaceBytes(c, numel); }
size_t topkWorkspace(const compress::Config& c, uint64_t numel) {
  return detail::topkWorkspaceBytes(c.approximate, numel, compress::keptEntries(c, numel),
                                    compress::headerValueBits(c));
}
size_t randomkWorkspace(const compress::Config& c, uint64_t numel) {
  return detail::randomkWorkspaceBytes(numel, compress::keptEntries(c, numel));
}

constexpr CudaKernels kCudaKernels[] = {
    {compress::Format::OneBit, detail::encodeOneBit, detail::decodeOneBit, detail::sumOneBit, noWorkspace},
    {compress::Format::Ternary, detail::encodeTernary, detail::decodeTernary, detail::sumTernary, ternaryWorkspace},
    {compress::Format::TopK, eachEncode<detail::encodeTopK>, eachDecode<detail::decodeSparse>, nullptr, topkWorkspace},
    {compress::Format::RandomK, eachEncode<detail::encodeRandomK>, eachDecode<detail::decodeSparse>, nullptr,
     randomkWorkspace},
    {compress::Format::Float16, detail::encodeCast, detail::decodeCast, detail::sumCast, noWorkspace},
    {compress::Format::BFloat16, detail::encodeCast, detail::decodeCast, detail::sumCast, noWorkspace},
};

constexpr bool followsFormats() {
  if (sizeof(kCudaKernels) / sizeof(kCudaKernels[0]) != compress::kFormatCount) return false;
  for (size_t i = 0; i < compress::kFormatCount; ++i) {
    if (kCudaKernels[i].format != compress::kFormats[i].format) return false;
  }
  return true;
}
static_assert(followsFormats(), "one row of CUDA kernels per row of compress::kFormats, in its order");

const CudaKernels& kernelsOf(compress::Format format) {
  const size_t index = compress::formatIndex(format);
  DDLCOMM_CHECK(index < compress::kFormatCount, ErrorKind::InvalidArgument, "unknown compression format ",
                int(format));
  return kCudaKernels[index];
}

void checkConfig(const compress::Config& c, size_t numel) {
  const compress::FormatTraits* row = compress::findFormat(uint8_t(c.format));
  DDLCOMM_CHECK(row != nullptr, ErrorKind::InvalidArgument, "unknown compression format ", int(c.format));
  switch (row->family) {
    case compress::Family::Blocks: {
      const bool stochastic = compress::allowsFlag(c.format, compress::kFlagStochastic);
      DDLCOMM_CHECK(c.blockSize >= 1, ErrorKind::InvalidArgument, "compression blockSize must be >= 1");
      DDLCOMM_CHECK(!stochastic || (c.clip >= 0.f && std::isfinite(c.clip)), ErrorKind::InvalidArgument,
                    "ternary clip must be a finite value >= 0, got ", c.clip);
      DDLCOMM_CHECK(!stochastic || c.stochastic || c.clip == 0.f, ErrorKind::InvalidArgument,
                    "clip applies to stochastic ternary only");
      break;
    }
    case compress::Family::Sparse:
      DDLCOMM_CHECK(numel <= compress::kMaxSparseNumel, ErrorKind::InvalidArgument,
                    "top-k / random-k payloads index with uint32: at most ", compress::kMaxSparseNumel,
                    " elements, got ", numel);
      DDLCOMM_CHECK(c.k > 0 || (c.ratio > 0.0 && c.ratio <= 1.0), ErrorKind::InvalidArgument,
                    "top-k / random-k ratio must be in (0, 1], got ", c.ratio);
      break;
    case compress::Family::Cast: break;
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
  DDLCOMM_CHECK(
      compress::isValueBits(info.valueBits) && (info.valueBits == 0 || compress::takesValueCodes(info.format)),
      ErrorKind::Protocol, what, ": invalid value bits ", info.valueBits);
  const bool two =
      (info.flags & compress::kFlagTwoScales) && compress::allowsFlag(info.format, compress::kFlagTwoScales);
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
  kernelsOf(a.format).decode(&a, 1);
}

// The checked arguments of one encode (encodeCuda's).
detail::EncodeArgs encodeArgs(const compress::Config& config, DataType xType, const void* x, float* residual,
                              size_t numel, uint64_t stream, uint8_t* payload, size_t capacity, void* workspace,
                              size_t workspaceBytes, cudaStream_t cudaStream) {
  checkConfig(config, numel);
  DDLCOMM_CHECK(xType == DataType::Float32 || xType == DataType::Float16 || xType == DataType::BFloat16,
                ErrorKind::UnsupportedType,
                "compression input must be torch.float32, torch.float16 or torch.bfloat16, got ",
                dataTypeName(xType));
  DDLCOMM_CHECK(x != nullptr || numel == 0, ErrorKind::InvalidArgument, "encodeCuda: null input");
  checkPayloadPointer(payload, "encodeCuda");
  const compress::PayloadLayout layout = compress::payloadLayout(config, numel);
  DDLCOMM_CHECK(capacity >= layout.bytes, ErrorKind::InvalidArgument, "encodeCuda: payload capacity ", capacity,
                " < ", layout.bytes, " bytes needed");
  const size_t needed = kernelsOf(config.format).workspaceBytes(config, numel);
  DDLCOMM_CHECK(workspaceBytes >= needed && (needed == 0 || workspace != nullptr), ErrorKind::InvalidArgument,
                "encodeCuda: workspace of ", workspaceBytes, " bytes, ", needed, " needed");
  DDLCOMM_CHECK(reinterpret_cast<uintptr_t>(workspace) % 256 == 0, ErrorKind::InvalidArgument,
                "encodeCuda: the workspace must be 256-byte aligned");
  const HeaderWords header = headerWords(compress::makeHeader(config, numel));
  const uint64_t k = compress::keptEntries(config, numel);
  return detail::EncodeArgs{config, xType,  x,      residual,  numel,          stream,
                            k,      payload, layout, header,   workspace, workspaceBytes, cudaStream};
}

}  // namespace

size_t encodedBytesCuda(const compress::Config& config, size_t numel) {
  checkConfig(config, numel);
  return compress::payloadLayout(config, numel).bytes;
}

compress::PayloadInfo expectedInfo(const compress::Config& config, size_t numel, size_t bytes) {
  const size_t expected = encodedBytesCuda(config, numel);
  DDLCOMM_CHECK(bytes == expected, ErrorKind::Protocol, "a ", compress::formatName(config.format), " payload of ",
                numel, " elements has ", expected, " bytes, got ", bytes);
  return {config.format, compress::headerFlags(config), compress::headerBlockSize(config), uint64_t(numel),
          compress::keptEntries(config, numel), compress::headerValueBits(config)};
}

size_t encodeWorkspaceBytes(const compress::Config& config, DataType, size_t numel) {
  checkConfig(config, numel);
  return kernelsOf(config.format).workspaceBytes(config, numel);
}

size_t encodeCuda(const compress::Config& config, DataType xType, const void* x, float* residual, size_t numel,
                  uint64_t stream, uint8_t* payload, size_t capacity, void* workspace, size_t workspaceBytes,
                  cudaStream_t cudaStream) {
  const detail::EncodeArgs a =
      encodeArgs(config, xType, x, residual, numel, stream, payload, capacity, workspace, workspaceBytes, cudaStream);
  kernelsOf(config.format).encode(&a, 1);
  return a.layout.bytes;
}

void encodeChunksCuda(const compress::Config& config, DataType xType, const EncodeChunk* chunks, size_t n,
                      void* workspace, size_t workspaceBytes, cudaStream_t cudaStream) {
  std::vector<detail::EncodeArgs> args;
  args.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    const EncodeChunk& c = chunks[i];
    args.push_back(encodeArgs(config, xType, c.x, c.residual, c.numel, c.stream, c.payload, c.capacity, workspace,
                              workspaceBytes, cudaStream));
  }
  if (n > 0) kernelsOf(config.format).encode(args.data(), n);
}

void decodeCuda(const compress::PayloadInfo& info, const uint8_t* payload, size_t bytes, DataType outType, void* out,
                size_t numel, cudaStream_t cudaStream) {
  runDecode(decodeArgs(info, payload, bytes, outType, out, numel, false, cudaStream, "decodeCuda"));
}

void decodeAccumulateCuda(const compress::PayloadInfo& info, const uint8_t* payload, size_t bytes, float* out,
                          size_t numel, cudaStream_t cudaStream) {
  runDecode(decodeArgs(info, payload, bytes, DataType::Float32, out, numel, true, cudaStream, "decodeAccumulateCuda"));
}

void decodeChunksCuda(const compress::Config& config, const DecodeChunk* chunks, size_t n, DataType outType,
                      cudaStream_t cudaStream) {
  std::vector<detail::DecodeArgs> args;
  args.reserve(n);
  for (size_t j = 0; j < n; ++j) {
    const DecodeChunk& c = chunks[j];
    if (c.numel == 0) continue;  // as decodeCuda: nothing to write
    args.push_back(decodeArgs(expectedInfo(config, c.numel, c.bytes), c.payload, c.bytes, outType, c.out, c.numel,
                              false, cudaStream, "decodeChunksCuda"));
  }
  if (!args.empty()) kernelsOf(config.format).decode(args.data(), args.size());
}

void sumPayloadsCuda(const compress::Config& config, const uint8_t* const* payloads, size_t n, size_t numel,
                     float scale, float* out, cudaStream_t cudaStream) {
  const CudaKernels& kernels = kernelsOf(config.format);
  DDLCOMM_CHECK(kernels.sum != nullptr, ErrorKind::InvalidArgument, "sumPayloadsCuda: ",
                compress::formatName(config.format), " payloads are summed sparsely (decodeAccumulateCuda)");
  DDLCOMM_CHECK(n >= 1, ErrorKind::InvalidArgument, "sumPayloadsCuda: no payload to sum");
  if (numel == 0) return;
  const size_t bytes = encodedBytesCuda(config, numel);
  const compress::PayloadInfo info = expectedInfo(config, numel, bytes);
  std::vector<detail::DecodeArgs> args;
  args.reserve(n);
  for (size_t j = 0; j < n; ++j) {
    args.push_back(decodeArgs(info, payloads[j], bytes, DataType::Float32, out, numel,
                              true, cudaStream, "sumPayloadsCuda"));
  }
  kernels.sum(args.data(), n, scale, out);
}

}  // namespace ddlcomm::gpu
