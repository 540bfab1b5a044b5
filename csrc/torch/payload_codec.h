// What the compressed all-reduce and reduce-scatter share (collective_compressed.cc and
// collective_reduce_scatter.cc): encoding and decoding on the tensors' device, the way
// payloads travel, and how a failed exchange is reported. Payload tensors are uint8,
// 4-byte aligned; buffers that travel are left uninitialized (the bytes that pad a payload to
// its slot are sent but never read, and a fill would cost a kernel launch per buffer on a GPU).
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <vector>

#include "compress/compress.h"

namespace ddlcomm::torch_glue {

// Encodes and decodes on the tensors' device: CPU kernels, or CUDA kernels on the current stream.
class Codec {
 public:
  Codec(const compress::Config& config, c10::Device device) : config_(config), device_(device) {}

  const compress::Config& config() const { return config_; }
  size_t bytes(size_t numel) const { return compress::encodedBytes(config_, numel); }

  void encode(const at::Tensor& x, const at::Tensor* residual, uint64_t stream, const at::Tensor& payload) const;
  // encode() of every chunk xs[i] (with residuals[i] where residuals is not empty, and
  // streams[i]) into payloads[i]: on a GPU one launch for the chunks of a block format or a
  // cast (gpu::encodeChunksCuda).
  void encodeChunks(const std::vector<at::Tensor>& xs, const std::vector<at::Tensor>& residuals,
                    const std::vector<uint64_t>& streams, const std::vector<at::Tensor>& payloads) const;
  // The reduce step: `out` = encode(scale * the float32 sum, in row order, of decode(the first
  // `bytes` bytes of every row), with the server residual). On the CPU one fused pass
  // (compress::reduceEncode); on a GPU the sum is taken in `chunk` (the rows' values, already
  // encoded) where it is float32.
  void reduceEncode(const at::Tensor& rows, size_t bytes, const at::Tensor& chunk, float scale,
                    const at::Tensor* server, uint64_t stream, const at::Tensor& out) const;
  // `out` = scale * the float32 sum, in row order from 0, of decode(the first `bytes` bytes of
  // every row): on a GPU one launch for a block format or a cast (gpu::sumPayloadsCuda).
  void sum(const at::Tensor& rows, size_t bytes, float scale, const at::Tensor& out) const;
  // sum() of sparse payloads: zero where none carries an index (compress::sumSparse on the CPU).
  void sumSparse(const at::Tensor& rows, size_t bytes, float scale, const at::Tensor& out) const;
  // out (its device, float32 where accumulate) = or += decode(the first `n` bytes of payload).
  void decode(const at::Tensor& payload, size_t n, const at::Tensor& out, bool accumulate) const;
  // decode() of the first bytes[j] bytes of payloads[j] into outs[j], for every j: on a GPU one
  // launch for a block format or a cast (gpu::decodeChunksCuda).
  void decodeChunks(const std::vector<at::Tensor>& payloads, const std::vector<size_t>& bytes,
                    const std::vector<at::Tensor>& outs) const;

 private:
  compress::Config config_;
  c10::Device device_;
};

// Where the payloads travel: with the tensor, or (staged) through pinned host memory.
class Wire {
 public:
  Wire(const compress::Config& config, c10::Device device, bool staged)
      : config_(config), device_(device), staged_(staged) {}

  at::Tensor empty(size_t n) const;
  // `payload` where the collective can send it: a pinned host copy when staged, made on the
  // current stream and waited for through an event (never a device synchronization).
  at::Tensor send(const at::Tensor& payload) const;
  // Rows that arrived, on the tensor's device. Staged rows are validated on the host first:
  // row j's first bytes[j] bytes must be a payload of this config carrying numels[j] elements.
  at::Tensor receive(const at::Tensor& rows, const std::vector<size_t>& bytes,
                     const std::vector<size_t>& numels) const;

 private:
  compress::Config config_;
  c10::Device device_;
  bool staged_;
};

// Waits for an exchange. A failure raises DistBackendError on every rank, as ddlcomm's
// collectives do, naming this rank and what the backend said (gloo's collectives name the
// peer by its address).
void wait(const c10d::Backend& backend, const c10::intrusive_ptr<c10d::Work>& work);

// Random-k sends a random sample, which can miss a non-finite entry; a non-finite value on any
// rank must still make the result non-finite everywhere (GradScaler then skips the step), and
// no residual may take it in. Whether any rank of `group` holds one in `flat`: one flag
// all-reduced (a float32 sum is finite only if every element is, unless it overflowed: then
// each element is checked). Both compressed collectives ask it first.
bool nonFiniteAnywhere(c10d::Backend& group, bool staged, const at::Tensor& flat);

inline at::Tensor slice(const at::Tensor& t, size_t begin, size_t end) {
  return t.slice(0, int64_t(begin), int64_t(end));
}

}  // namespace ddlcomm::torch_glue
