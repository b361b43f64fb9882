// The hand-off between the threads that start, feed or wake operations and
// one device's worker thread: a queue of new tasks, and an epoch that moves
// whenever something the worker may be waiting for has happened (a peer's
// progress, an arrival, a failure). A worker sleeps only until the epoch
// moves, so a wake-up between its last look and its sleep is never lost.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <list>
#include <mutex>

namespace jaxring {

template <typename Task>
class TaskQueue {
 public:
  using Clock = std::chrono::steady_clock;

  void submit(Task task) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      incoming_.push_back(std::move(task));
      ++epoch_;
    }
    cv_.notify_one();
  }

  void wake() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      ++epoch_;
    }
    cv_.notify_one();
  }

  // Moves the new tasks into `active`, first waiting for one if `active` is
  // empty. Returns the epoch at that moment, for changed() and wait_until().
  uint64_t collect(std::list<Task>& active) {
    std::unique_lock<std::mutex> lock(mu_);
    if (active.empty()) cv_.wait(lock, [&] { return !incoming_.empty(); });
    while (!incoming_.empty()) {
      active.push_back(std::move(incoming_.front()));
      incoming_.pop_front();
    }
    return epoch_;
  }

  bool changed(uint64_t seen) {
    std::lock_guard<std::mutex> lock(mu_);
    return epoch_ != seen || !incoming_.empty();
  }

  // Sleeps until the epoch moves past `seen`, a task arrives, or `until`.
  void wait_until(uint64_t seen, Clock::time_point until) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_until(lock, until,
                   [&] { return epoch_ != seen || !incoming_.empty(); });
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Task> incoming_;
  uint64_t epoch_ = 0;
};

}  // namespace jaxring
