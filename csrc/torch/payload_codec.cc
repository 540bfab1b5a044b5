// The payload codec both compressed collectives use (payload_codec.h): encodes, decodes and
// device copies on the current stream of the tensor's device. On the device no decoder reads
// or writes outside its payload and output whatever the bytes, but a corrupt payload is
// detected only where payloads pass through host memory (CPU tensors, staged CUDA tensors).
#include "torch/payload_codec.h"

#include <c10/core/DeviceGuard.h>
#include <c10/core/Event.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <algorithm>

#include "common/error.h"
#include "torch/tensor_args.h"

#ifdef DDLCOMM_WITH_CUDA
#include "cuda/cuda_kernels.h"
#endif

namespace ddlcomm::torch_glue {
namespace {

at::Tensor bytesOn(c10::Device device, size_t n, bool pinned = false) {
  return at::empty({int64_t(n)}, at::TensorOptions().dtype(at::kByte).device(device).pinned_memory(pinned));
}

c10::Stream currentStream(c10::Device device) { return c10::impl::VirtualGuardImpl(device.type()).getStream(device); }

#ifdef DDLCOMM_WITH_CUDA
cudaStream_t cudaStreamOf(c10::Device device) {
  return static_cast<cudaStream_t>(currentStream(device).native_handle());
}
#endif

// Where every row of `rows` (uint8 [k, slot], on the CPU or a GPU) begins.
std::vector<const uint8_t*> rowPointers(const at::Tensor& rows) {
  std::vector<const uint8_t*> pointers;
  for (int64_t j = 0; j < rows.size(0); ++j) pointers.push_back(rows[j].data_ptr<uint8_t>());
  return pointers;
}

// Where float32 sums are accumulated: `out` itself when it is float32 and contiguous (its
// values were encoded already), else a new tensor. Zeroed either way. On the CPU a new tensor
// of a large chunk costs its page faults on every call, which is why the output is preferred.
at::Tensor accumulatorFor(const at::Tensor& out) {
  if (out.scalar_type() == at::kFloat && out.is_contiguous()) return out.zero_();
  return at::zeros({out.numel()}, out.options().dtype(at::kFloat));
}

}  // namespace


void Codec::encode(const at::Tensor& x, const at::Tensor* residual, uint64_t stream, const at::Tensor& payload) const {
  if (!device_.is_cpu()) {
    encodeChunks({x}, residual ? std::vector<at::Tensor>{*residual} : std::vector<at::Tensor>{}, {stream}, {payload});
    return;
  }
  const size_t numel = size_t(x.numel());
  float* r = residual ? residual->data_ptr<float>() : nullptr;
  const size_t written = compress::encode(config_, toDataType(x), x.data_ptr(), r, numel, stream,
                                          payload.data_ptr<uint8_t>(), size_t(payload.numel()));
  DDLCOMM_CHECK(written == bytes(numel), ErrorKind::Protocol, "payload of ", written, " bytes, expected ",
                bytes(numel));
}

void Codec::encodeChunks(const std::vector<at::Tensor>& xs, const std::vector<at::Tensor>& residuals,
                         const std::vector<uint64_t>& streams, const std::vector<at::Tensor>& payloads) const {
  if (device_.is_cpu()) {
    for (size_t i = 0; i < xs.size(); ++i) {
      encode(xs[i], residuals.empty() ? nullptr : &residuals[i], streams[i], payloads[i]);
    }
    return;
  }
#ifdef DDLCOMM_WITH_CUDA
  const c10::DeviceGuard guard(device_);
  std::vector<gpu::EncodeChunk> chunks;
  size_t scratch = 0;
  for (size_t i = 0; i < xs.size(); ++i) {
    const size_t numel = size_t(xs[i].numel());
    scratch = std::max(scratch, gpu::encodeWorkspaceBytes(config_, toDataType(xs[i]), numel));
    chunks.push_back({xs[i].data_ptr(), residuals.empty() ? nullptr : residuals[i].data_ptr<float>(), numel,
                      streams[i], payloads[i].data_ptr<uint8_t>(), size_t(payloads[i].numel())});
  }
  // From torch's caching allocator, on the current stream: reused, never synchronized.
  const at::Tensor workspace = scratch ? bytesOn(device_, scratch) : at::Tensor();
  gpu::encodeChunksCuda(config_, xs.empty() ? DataType::Float32 : toDataType(xs[0]), chunks.data(), chunks.size(),
                        scratch ? workspace.data_ptr() : nullptr, scratch, cudaStreamOf(device_));
#else
  fail(ErrorKind::UnsupportedType, "ddlcomm was built without CUDA kernels: cannot compress a tensor on ", device_);
#endif
}

void Codec::reduceEncode(const at::Tensor& rows, size_t bytes, const at::Tensor& chunk, float scale,
                         const at::Tensor* server, uint64_t stream, const at::Tensor& out) const {
  if (device_.is_cpu()) {
    const std::vector<const uint8_t*> payloads = rowPointers(rows);
    const size_t numel = size_t(chunk.numel());
    compress::reduceEncode(config_, payloads.data(), payloads.size(), bytes, numel, scale,
                           server ? server->data_ptr<float>() : nullptr, stream, out.data_ptr<uint8_t>(),
                           size_t(out.numel()));
    return;
  }
  const at::Tensor acc = chunk.scalar_type() == at::kFloat && chunk.is_contiguous()
                             ? chunk
                             : at::empty({chunk.numel()}, chunk.options().dtype(at::kFloat));
  sum(rows, bytes, scale, acc);
  encode(acc, server, stream, out);
}

void Codec::sum(const at::Tensor& rows, size_t bytes, float scale, const at::Tensor& out) const {
  at::Tensor acc;
  if (device_.is_cpu() || compress::isSparse(config_.format)) {
    acc = accumulatorFor(out);
    for (int64_t j = 0; j < rows.size(0); ++j) decode(rows[j], bytes, acc, true);
    if (scale != 1.f) acc.mul_(scale);
  } else {
#ifdef DDLCOMM_WITH_CUDA
    const c10::DeviceGuard guard(device_);
    const bool inPlace = out.scalar_type() == at::kFloat && out.is_contiguous();
    acc = inPlace ? out : at::empty({out.numel()}, out.options().dtype(at::kFloat));
    gpu::expectedInfo(config_, size_t(out.numel()), bytes);  // the rows' size, as decode() checks it
    const std::vector<const uint8_t*> payloads = rowPointers(rows);
    gpu::sumPayloadsCuda(config_, payloads.data(), payloads.size(), size_t(out.numel()), scale, acc.data_ptr<float>(),
                         cudaStreamOf(device_));
#else
    (void)bytes;
    fail(ErrorKind::UnsupportedType, "ddlcomm was built without CUDA kernels: cannot decode into a tensor on ",
         device_);
#endif
  }
  if (!acc.is_same(out)) out.copy_(acc.view(out.sizes()));
}

void Codec::sumSparse(const at::Tensor& rows, size_t bytes, float scale, const at::Tensor& out) const {
  if (!device_.is_cpu()) return sum(rows, bytes, scale, out);
  const std::vector<const uint8_t*> payloads = rowPointers(rows);
  out.zero_();
  compress::sumSparse(config_, payloads.data(), payloads.size(), bytes, size_t(out.numel()), scale, toDataType(out),
                      out.data_ptr());
}

void Codec::decode(const at::Tensor& payload, size_t n, const at::Tensor& out, bool accumulate) const {
  const size_t numel = size_t(out.numel());
  const uint8_t* p = payload.data_ptr<uint8_t>();
  if (device_.is_cpu()) {
    compress::checkPayloadConfig(p, n, config_);
    if (accumulate) {
      compress::decodeAccumulate(p, n, out.data_ptr<float>(), numel);
    } else {
      compress::decode(p, n, toDataType(out), out.data_ptr(), numel);
    }
    return;
  }
  if (!accumulate) return decodeChunks({payload}, {n}, {out});
#ifdef DDLCOMM_WITH_CUDA
  const c10::DeviceGuard guard(device_);
  gpu::decodeAccumulateCuda(gpu::expectedInfo(config_, numel, n), p, n, out.data_ptr<float>(), numel,
                            cudaStreamOf(device_));
#else
  fail(ErrorKind::UnsupportedType, "ddlcomm was built without CUDA kernels: cannot decode into a tensor on ",
       device_);
#endif
}

void Codec::decodeChunks(const std::vector<at::Tensor>& payloads, const std::vector<size_t>& bytes,
                         const std::vector<at::Tensor>& outs) const {
  if (device_.is_cpu()) {
    for (size_t j = 0; j < payloads.size(); ++j) decode(payloads[j], bytes[j], outs[j], false);
    return;
  }
#ifdef DDLCOMM_WITH_CUDA
  const c10::DeviceGuard guard(device_);
  std::vector<gpu::DecodeChunk> chunks;
  for (size_t j = 0; j < payloads.size(); ++j) {
    chunks.push_back({payloads[j].data_ptr<uint8_t>(), bytes[j], outs[j].data_ptr(), size_t(outs[j].numel())});
  }
  gpu::decodeChunksCuda(config_, chunks.data(), chunks.size(), outs.empty() ? DataType::Float32 : toDataType(outs[0]),
                        cudaStreamOf(device_));
#else
  fail(ErrorKind::UnsupportedType, "ddlcomm was built without CUDA kernels: cannot decode into a tensor on ",
       device_);
#endif
}

at::Tensor Wire::empty(size_t n) const { return staged_ ? bytesOn(at::kCPU, n, true) : bytesOn(device_, n); }

at::Tensor Wire::send(const at::Tensor& payload) const {
  if (!staged_) return payload;
  at::Tensor host = bytesOn(at::kCPU, size_t(payload.numel()), true);
  host.copy_(payload, /*non_blocking=*/true);
  c10::Event copied(device_.type());
  copied.record(currentStream(device_));
  copied.synchronize();
  return host;
}

at::Tensor Wire::receive(const at::Tensor& rows, const std::vector<size_t>& bytes,
                         const std::vector<size_t>& numels) const {
  if (!staged_) return rows;
  for (size_t j = 0; j < bytes.size(); ++j) {
    const uint8_t* p = rows[int64_t(j)].data_ptr<uint8_t>();
    compress::checkPayloadConfig(p, bytes[j], config_);
    const uint64_t carried = compress::inspect(p, bytes[j]).numel;
    DDLCOMM_CHECK(carried == numels[j], ErrorKind::Protocol, "rank ", j, "'s payload carries ", carried,
                  " elements, ", numels[j], " were expected");
  }
  return rows.to(device_, /*non_blocking=*/true);
}

void wait(const c10d::Backend& backend, const c10::intrusive_ptr<c10d::Work>& work) {
  try {
    work->wait();
  } catch (const c10::DistBackendError&) {
    throw;
  } catch (const std::exception& e) {
    C10_THROW_ERROR(DistBackendError, c10::str("[ddlcomm rank ", backend.getRank(), "/", backend.getSize(),
                                               "] a compressed collective's exchange over ", backend.getBackendName(),
                                               " failed: ", e.what()));
  }
}

bool nonFiniteAnywhere(c10d::Backend& group, bool staged, const at::Tensor& flat) {
  const bool finite = at::isfinite(flat.sum(at::kFloat)).item<bool>() || at::isfinite(flat).all().item<bool>();
  const c10::Device device = staged ? c10::Device(at::kCPU) : flat.device();
  std::vector<at::Tensor> flag{at::full({1}, finite ? 0 : 1, at::TensorOptions().dtype(at::kByte).device(device))};
  c10d::AllreduceOptions max;
  max.reduceOp = c10d::ReduceOp::MAX;
  wait(group, group.allreduce(flag, max));
  return flag[0].item<uint8_t>() != 0;
}

}  // namespace ddlcomm::torch_glue
