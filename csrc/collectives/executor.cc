#include "collectives/executor.h"

#include <algorithm>

namespace ddlcomm {

Executor::Executor(std::unique_ptr<Communicator> communicator)
    : comm_(std::move(communicator)), rank_(comm_->rank()), size_(comm_->size()) {
  thread_ = std::thread([this] { loop(); });
}

Executor::~Executor() { shutdown(); }

void Executor::submit(std::function<void(Communicator&)> task, Done done) {
  if (onOwningThread()) {  // issued by a completion callback: run it now, in order
    runNow(task, done);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stopping_) {
      done(std::make_exception_ptr(Error(ErrorKind::Aborted, "the process group has been shut down")));
      return;
    }
    queue_.push_back(Item{std::move(task), std::move(done)});
  }
  cv_.notify_one();
  comm_->transport().wakeup();
}

bool Executor::onOwningThread() {
  const std::thread::id me = std::this_thread::get_id();
  if (me == thread_.get_id()) return true;
  std::lock_guard<std::mutex> lock(mutex_);
  return me == inlineThread_;
}

bool Executor::runInlineIfIdle(std::function<void(Communicator&)>& task, Done& done) {
  {
    std::unique_lock<std::mutex> lock(mutex_);
    // The executor is completing its last item (whose completion may be what woke this
    // caller): it is idle in a moment.
    if (finishing_) idle_.wait_for(lock, std::chrono::milliseconds(10), [&] { return !finishing_; });
    if (stopping_ || busy_ || !queue_.empty() || !pending_.empty() || inlineThread_ != std::thread::id()) return false;
    inlineThread_ = std::this_thread::get_id();
  }
  runNow(task, done);
  bool work;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    inlineThread_ = std::thread::id();
    work = stopping_ || !queue_.empty() || !pending_.empty();
  }
  // Whatever was queued meanwhile, or requests left pending, are the executor's again; an
  // idle executor is not woken (on a busy core that would cost the peers a context switch).
  if (work) cv_.notify_one();
  return true;
}

void Executor::submitPointToPoint(std::shared_ptr<Request> request, bool isSend, Done done, bool mayPostInline) {
  auto shared = std::make_shared<Done>(std::move(done));
  std::function<void(Communicator&)> post = [this, request, isSend, shared](Communicator& comm) {
    try {
      comm.throwIfAborted();
      if (isSend) {
        comm.transport().postSend(*request);
      } else {
        comm.transport().postRecv(*request);
      }
    } catch (const Error& e) {
      comm.failed(e);
    }
    pending_.push_back(Pending{request, std::move(*shared), Clock::now() + comm.options().timeout});
  };
  Done posted = [shared](std::exception_ptr error) {
    if (error) (*shared)(error);  // posting failed; success is reported by completePending
  };
  // Posting on the caller's thread when the group is idle takes the hand-off to the progress
  // thread off the message's path; a send that fits the shared-memory ring even completes
  // here. Whatever is left pending, the progress thread then moves.
  if (!mayPostInline || !runInlineIfIdle(post, posted)) submit(std::move(post), std::move(posted));
}

void Executor::abort(const std::string& reason) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (abortReason_.empty()) abortReason_ = reason.empty() ? "aborted" : reason;
    stopping_ = true;
  }
  cv_.notify_one();
  comm_->transport().wakeup();
}

void Executor::stop() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  cv_.notify_one();
  comm_->transport().wakeup();
}

void Executor::shutdown() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  cv_.notify_one();
  comm_->transport().wakeup();
  if (thread_.joinable()) thread_.join();
}

void Executor::completePending() {
  auto finished = std::stable_partition(pending_.begin(), pending_.end(),
                                        [](const Pending& p) { return !p.request->done(); });
  std::vector<Pending> done(std::make_move_iterator(finished), std::make_move_iterator(pending_.end()));
  pending_.erase(finished, pending_.end());
  for (Pending& p : done) {
    std::exception_ptr error;
    if (p.request->failed) {
      try {
        comm_->throwIfAborted();
        error = std::make_exception_ptr(Error(ErrorKind::Aborted, "request failed"));
      } catch (...) {
        error = std::current_exception();
      }
    }
    p.done(error);
  }
}

void Executor::progressPending(std::chrono::milliseconds maxWait) {
  Deadline now = Clock::now();
  Deadline earliest = now + maxWait;
  for (const Pending& p : pending_) earliest = std::min(earliest, p.deadline);
  try {
    if (earliest <= now) {
      const Pending& late = *std::min_element(pending_.begin(), pending_.end(), [](const Pending& a, const Pending& b) {
        return a.deadline < b.deadline;
      });
      comm_->failed(Error(ErrorKind::Timeout,
                          detail::concat("rank ", rank_, ": Timed out in ", late.request->signature.describe(),
                                         late.request->peer == kAnySource ? std::string(" from any rank")
                                                                          : " with rank " + std::to_string(late.request->peer))));
    }
    comm_->transport().poll(std::chrono::duration_cast<std::chrono::milliseconds>(earliest - now));
  } catch (const Error& e) {
    try {
      comm_->failed(e);
    } catch (const Error&) {
    }
  }
  completePending();
}

void Executor::loop() {
  while (true) {
    Item item;
    std::string abortReason;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      busy_ = false;
      if (finishing_) {
        finishing_ = false;
        idle_.notify_all();
      }
      // An inline operation owns the communicator until it returns.
      cv_.wait(lock, [&] {
        return inlineThread_ == std::thread::id() && (stopping_ || !queue_.empty() || !pending_.empty());
      });
      busy_ = true;
      abortReason = abortReason_;
      if (!abortReason.empty()) {
        std::deque<Item> dropped;
        dropped.swap(queue_);
        lock.unlock();
        comm_->transport().abort(ErrorKind::Aborted, "process group aborted: " + abortReason);
        auto error = std::make_exception_ptr(Error(ErrorKind::Aborted, "process group aborted: " + abortReason));
        for (Item& d : dropped) d.done(error);
        completePending();
        return;
      }
      if (queue_.empty()) {
        if (pending_.empty()) {
          if (stopping_) return;
          continue;
        }
      } else {
        item = std::move(queue_.front());
        queue_.pop_front();
      }
    }
    if (!item.task) {
      progressPending(std::chrono::milliseconds(100));
      continue;
    }
    runNow(item.task, item.done, /*fromLoop=*/true);
  }
}

void Executor::runNow(std::function<void(Communicator&)>& task, Done& done, bool fromLoop) {
  std::exception_ptr error;
  try {
    task(*comm_);
  } catch (...) {
    error = std::current_exception();
  }
  if (fromLoop) {
    std::lock_guard<std::mutex> lock(mutex_);
    finishing_ = queue_.empty();
  }
  done(error);
  completePending();
}

}  // namespace ddlcomm
