#include "collectives/store_courier.h"

#include <condition_variable>
#include <mutex>

namespace ddlcomm {

struct StoreCourier::State {
  std::shared_ptr<KeyValueStore> store;
  std::mutex mutex;
  std::condition_variable changed;
  Task task;  // the call waiting to run, if any
  uint64_t started = 0, finished = 0;
  std::optional<std::string> result;
  bool stuck = false;  // a call overran its bound: the store is unreachable
  bool stop = false;
};

StoreCourier::StoreCourier(std::shared_ptr<KeyValueStore> store) : state_(std::make_shared<State>()) {
  state_->store = std::move(store);
}

StoreCourier::~StoreCourier() {
  bool stuck;
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    state_->stop = true;
    stuck = state_->stuck;
  }
  state_->changed.notify_all();
  if (!thread_.joinable()) return;
  if (stuck) {
    thread_.detach();
  } else {
    thread_.join();
  }
}

void StoreCourier::serve(std::shared_ptr<State> s) {
  std::unique_lock<std::mutex> lock(s->mutex);
  while (true) {
    s->changed.wait(lock, [&] { return s->stop || s->task; });
    if (!s->task) return;
    Task task = std::move(s->task);
    s->task = nullptr;
    lock.unlock();
    std::optional<std::string> result;
    try {
      result = task(*s->store);
    } catch (...) {
      // The store failed (it may have died with a rank): no answer.
    }
    lock.lock();
    s->result = std::move(result);
    ++s->finished;
    s->changed.notify_all();
  }
}

std::optional<std::string> StoreCourier::call(Task task, std::chrono::milliseconds bound) {
  std::unique_lock<std::mutex> lock(state_->mutex);
  // The previous call has finished, or it overran and the store counts as unreachable.
  if (state_->stuck || !state_->store) return std::nullopt;
  if (!thread_.joinable()) thread_ = std::thread(serve, state_);
  const uint64_t ticket = ++state_->started;
  state_->task = std::move(task);
  state_->changed.notify_all();
  if (!state_->changed.wait_for(lock, bound, [&] { return state_->finished >= ticket; })) {
    state_->stuck = true;
    state_->changed.notify_all();
    return std::nullopt;
  }
  return state_->result;
}

}  // namespace ddlcomm
