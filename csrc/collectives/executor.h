// The progress thread of one process group. It runs the group's operations one after
// another in submission order (so every rank posts its messages in the same order), and
// keeps point-to-point requests moving between and during them. The Executor owns and
// joins its thread; the Communicator is only ever touched from that thread.
#pragma once

#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "collectives/communicator.h"

namespace ddlcomm {

class Executor {
 public:
  using Done = std::function<void(std::exception_ptr)>;  // called on the executor thread

  explicit Executor(std::unique_ptr<Communicator> communicator);
  ~Executor();  // finishes queued work (each bounded by the timeout), then joins
  Executor(const Executor&) = delete;
  Executor& operator=(const Executor&) = delete;

  // Runs `task` (a blocking collective on the communicator) after everything submitted before.
  // Completion callbacks run on the executor thread, in order. An operation submitted from
  // such a callback runs at once, inline: a callback may wait for it (PyTorch's PowerSGD
  // hook does), and every rank then runs it at the same point, right after the operation
  // whose callback issued it.
  void submit(std::function<void(Communicator&)> task, Done done);
  // Runs `task` and `done` on the calling thread instead when the group is idle (nothing
  // queued, running or pending), and returns true; otherwise does nothing and returns false.
  // A small collective then pays no thread hand-off, which is most of its latency.
  bool runInlineIfIdle(std::function<void(Communicator&)>& task, Done& done);
  // Posts a send or receive in submission order; `done` fires when it completes, while
  // later operations already proceed. `request` must stay alive until then. With
  // `mayPostInline`, an idle group posts it on the calling thread, as runInlineIfIdle.
  void submitPointToPoint(std::shared_ptr<Request> request, bool isSend, Done done, bool mayPostInline = false);

  // Fails everything queued or in flight and makes the group unusable. Thread-safe.
  void abort(const std::string& reason);
  // Stops accepting work, drains the queue, joins the thread. Idempotent.
  void shutdown();
  // Stops accepting work and lets the thread finish by itself, without joining it: for a
  // caller on a thread the executor owns or waits for (a completion callback), which cannot
  // join it.
  void stop();
  // Whether this thread is the executor's or runs an operation inline.
  bool onOwningThread();

  int rank() const { return rank_; }
  int size() const { return size_; }

 private:
  struct Item {
    std::function<void(Communicator&)> task;
    Done done;
  };
  struct Pending {
    std::shared_ptr<Request> request;
    Done done;
    Deadline deadline;
  };
  void loop();
  void runNow(std::function<void(Communicator&)>& task, Done& done, bool fromLoop = false);
  void progressPending(std::chrono::milliseconds maxWait);
  void completePending();

  std::unique_ptr<Communicator> comm_;
  const int rank_;
  const int size_;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::condition_variable idle_;  // signalled when the executor leaves finishing_
  std::deque<Item> queue_;
  bool stopping_ = false;
  bool busy_ = false;  // the executor thread is running an item or progressing pending requests
  bool finishing_ = false;  // it ran its last queued item and is completing it
  std::thread::id inlineThread_;  // the caller running an operation inline; the executor waits
  std::string abortReason_;
  // Touched by the executor thread, or by the inline thread while the executor waits.
  std::vector<Pending> pending_;
  std::thread thread_;
};

}  // namespace ddlcomm
