#include "cpu/timeline.h"

#include <atomic>
#include <chrono>
#include <mutex>
#include <utility>

namespace jaxring {

namespace {

std::atomic<bool> g_enabled{false};

struct Store {
  std::mutex mu;
  std::vector<TimelineEvent> events;
};

Store& store() {
  static Store* s = new Store();  // leaked: workers may record at exit
  return *s;
}

}  // namespace

void timeline_enable(bool on) { g_enabled.store(on); }

bool timeline_enabled() { return g_enabled.load(std::memory_order_relaxed); }

void timeline_record(const TimelineEvent& e) {
  Store& s = store();
  std::lock_guard<std::mutex> lock(s.mu);
  s.events.push_back(e);
}

std::vector<TimelineEvent> timeline_take() {
  Store& s = store();
  std::lock_guard<std::mutex> lock(s.mu);
  return std::exchange(s.events, {});
}

int64_t timeline_now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace jaxring
