#include "torch/device_staging.h"

#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>

namespace ddlcomm::torch_glue {
namespace {

// An event at what `device`'s current stream has issued so far.
std::shared_ptr<c10::Event> markCurrentStream(c10::Device device) {
  auto mark = std::make_shared<c10::Event>(device.type());
  mark->record(c10::impl::VirtualGuardImpl(device.type()).getStream(device));
  return mark;
}

// `issue` on a stream from torch's pool of `device`, after `after` (when given), waited for
// on the host.
void onPoolStream(c10::Device device, const c10::Event* after, const std::function<void()>& issue) {
  const c10::Stream stream = c10::impl::VirtualGuardImpl(device.type()).getStreamFromGlobalPool(device);
  c10::StreamGuard guard(stream);
  if (after) after->block(stream);
  issue();
  c10::Event done(device.type());
  done.record(stream);
  done.synchronize();
}

}  // namespace

bool DeviceStaging::needed(const std::vector<at::Tensor>& tensors) {
  for (const auto& t : tensors) {
    if (t.defined() && t.is_cuda()) return true;
  }
  return false;
}

bool DeviceStaging::needed(const std::vector<std::vector<at::Tensor>>& lists) {
  for (const auto& list : lists) {
    if (needed(list)) return true;
  }
  return false;
}

at::Tensor DeviceStaging::mirror(const at::Tensor& t, bool copyIn, bool copyOut) {
  if (!t.defined() || t.layout() != at::kStrided) return t;  // the operation's checks refuse the rest
  TORCH_CHECK_VALUE(t.is_cpu() || t.is_cuda(), "ddlcomm: a tensor is on ", t.device(),
                    "; ddlcomm handles CPU and CUDA tensors");
  const bool mixed = t.is_cpu() ? device_.has_value() : (cpu_ || (device_ && *device_ != t.device()));
  TORCH_CHECK_VALUE(!mixed, "ddlcomm: an operation mixes tensors on ", device_ ? *device_ : c10::Device(at::kCPU),
                    " and ", t.device(), ": pass them all on one device");
  if (t.is_cpu()) {
    cpu_ = true;
    return t;
  }
  device_ = t.device();
  at::Tensor host = at::empty(t.sizes(), t.options().device(at::kCPU).pinned_memory(true));
  // On the current stream of t's device, after the kernels that produced t.
  if (copyIn) host.copy_(t, /*non_blocking=*/true);
  if (copyOut) outputs_.push_back({t, host});
  return host;
}

std::vector<at::Tensor> DeviceStaging::input(const std::vector<at::Tensor>& ts) {
  std::vector<at::Tensor> result;
  for (const auto& t : ts) result.push_back(input(t));
  return result;
}

std::vector<at::Tensor> DeviceStaging::output(const std::vector<at::Tensor>& ts) {
  std::vector<at::Tensor> result;
  for (const auto& t : ts) result.push_back(output(t));
  return result;
}

std::vector<at::Tensor> DeviceStaging::inplace(const std::vector<at::Tensor>& ts) {
  std::vector<at::Tensor> result;
  for (const auto& t : ts) result.push_back(inplace(t));
  return result;
}

std::vector<std::vector<at::Tensor>> DeviceStaging::input(const std::vector<std::vector<at::Tensor>>& lists) {
  std::vector<std::vector<at::Tensor>> result;
  for (const auto& list : lists) result.push_back(input(list));
  return result;
}

std::vector<std::vector<at::Tensor>> DeviceStaging::output(const std::vector<std::vector<at::Tensor>>& lists) {
  std::vector<std::vector<at::Tensor>> result;
  for (const auto& list : lists) result.push_back(output(list));
  return result;
}

void DeviceStaging::recordCopies() {
  if (device_) copied_ = markCurrentStream(*device_);
}

void DeviceStaging::waitForCopies() const {
  if (copied_) copied_->synchronize();
}

void DeviceStaging::copyBack() const {
  if (!device_ || outputs_.empty()) return;
  onPoolStream(*device_, nullptr, [&] {
    for (const auto& o : outputs_) o.user.copy_(o.host, /*non_blocking=*/true);
  });
}

DeviceWork::DeviceWork(c10::Device device) {
  if (device.is_cpu()) return;
  device_ = device;
  called_ = markCurrentStream(device);
}

void DeviceWork::run(const std::function<void()>& issue) const {
  if (device_) {
    onPoolStream(*device_, called_.get(), issue);
  } else {
    issue();
  }
}

std::vector<at::Tensor> DeviceStaging::userOutputs() const {
  std::vector<at::Tensor> result;
  for (const auto& o : outputs_) result.push_back(o.user);
  return result;
}

}  // namespace ddlcomm::torch_glue
