// Store calls made on the failure path, with a bound. A c10d store call blocks without a
// deadline, so on a rank whose network is gone (a partitioned host) it would hang the very
// error report it is part of. The courier makes the call on its own thread and gives up
// waiting after the bound; from then on the store counts as unreachable and is not asked
// again, so the rank still fails at its own timeout.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include "transport/store.h"

namespace ddlcomm {

class StoreCourier {
 public:
  using Task = std::function<std::string(KeyValueStore&)>;

  explicit StoreCourier(std::shared_ptr<KeyValueStore> store);
  // Joins the thread; if a call is stuck in the store, detaches it instead: a blocked
  // socket read cannot be cancelled, and waiting for it would hang destroy_process_group.
  ~StoreCourier();
  StoreCourier(const StoreCourier&) = delete;
  StoreCourier& operator=(const StoreCourier&) = delete;

  // Runs `task` (which must capture by value: it may outlive this call) and returns its
  // result, or nullopt if the store is unreachable, the task threw, or it took longer
  // than `bound`. One calling thread (the communicator's: its executor); the courier's
  // thread starts on first use.
  std::optional<std::string> call(Task task, std::chrono::milliseconds bound);

 private:
  struct State;
  static void serve(std::shared_ptr<State> state);

  std::shared_ptr<State> state_;  // shared with the thread, which may outlive this object
  std::thread thread_;
};

}  // namespace ddlcomm
