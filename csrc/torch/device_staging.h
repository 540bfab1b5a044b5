// CUDA tensors through the CPU collectives. The caller's thread copies their values into
// pinned host mirrors on its current stream (asynchronously) and records an event; the
// progress thread waits for that event, runs the collective on the mirrors, copies the
// outputs back on a stream from torch's pool and waits for that copy before the Work
// completes. Events, never device synchronizations; gloo's CUDA path works the same way.
// Only torch's device-generic interfaces (c10::Event, c10::Stream) are used, so this file
// compiles against any torch and runs wherever torch has CUDA.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/Event.h>

#include <functional>
#include <memory>
#include <optional>
#include <vector>

namespace ddlcomm::torch_glue {

class DeviceStaging {
 public:
  // Whether any of the tensors is on a GPU (an operation then goes through staging).
  static bool needed(const std::vector<at::Tensor>& tensors);
  static bool needed(const std::vector<std::vector<at::Tensor>>& lists);

  // A pinned host mirror of `t` (`t` itself when it is on the CPU). input: the values are
  // copied in; output: the mirror is copied back into `t` after the collective; inplace: both.
  at::Tensor input(const at::Tensor& t) { return mirror(t, true, false); }
  at::Tensor output(const at::Tensor& t) { return mirror(t, false, true); }
  at::Tensor inplace(const at::Tensor& t) { return mirror(t, true, true); }
  std::vector<at::Tensor> input(const std::vector<at::Tensor>& ts);
  std::vector<at::Tensor> output(const std::vector<at::Tensor>& ts);
  std::vector<at::Tensor> inplace(const std::vector<at::Tensor>& ts);
  std::vector<std::vector<at::Tensor>> input(const std::vector<std::vector<at::Tensor>>& lists);
  std::vector<std::vector<at::Tensor>> output(const std::vector<std::vector<at::Tensor>>& lists);

  // Caller's thread, after the last mirror: marks the end of the copies to the host.
  void recordCopies();
  // Progress thread: waits for the copies to the host (before the collective) ...
  void waitForCopies() const;
  // ... and copies the outputs back to the GPU, waiting for that copy (after it).
  void copyBack() const;
  // The user's tensors that receive results (the Work's result()).
  std::vector<at::Tensor> userOutputs() const;

 private:
  at::Tensor mirror(const at::Tensor& t, bool copyIn, bool copyOut);

  struct Output {
    at::Tensor user;
    at::Tensor host;
  };
  std::vector<Output> outputs_;
  std::optional<c10::Device> device_;  // of the CUDA tensors
  bool cpu_ = false;                    // a CPU tensor was seen
  std::shared_ptr<c10::Event> copied_;
};

// GPU work that the progress thread issues for an operation of the caller's (the compressed
// all-reduce of a CUDA tensor over a CPU backend): on a stream from torch's pool that first
// waits for what the caller's current stream had issued at the call, and waited for on the
// host before the operation's Work completes, so that its future is complete on every
// stream. Nothing of this for a CPU tensor.
class DeviceWork {
 public:
  // Caller's thread: marks the caller's current stream of `device` (a CPU device: nothing).
  explicit DeviceWork(c10::Device device);
  // Progress thread: `issue` with that pool stream current, then waits for it on the host.
  void run(const std::function<void()>& issue) const;

 private:
  std::optional<c10::Device> device_;
  std::shared_ptr<c10::Event> called_;
};

}  // namespace ddlcomm::torch_glue
