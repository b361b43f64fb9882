#include "cpu/gang_start.h"

#include <chrono>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <utility>

namespace jaxring {

namespace {

using Clock = std::chrono::steady_clock;

// How long an operation whose ranks never all came (a failed run) is kept,
// counted from its last arrival, so that a latecomer still finds it.
constexpr auto kForgetAfter = std::chrono::seconds(60);

struct Gang {
  int arrived = 0;
  int waiting = 0;
  Clock::time_point last_arrival = Clock::now();
  std::condition_variable cv;
};

class GangTable {
 public:
  static GangTable& get() {
    // Leaked on purpose, like the transport's workers.
    static GangTable* t = new GangTable();
    return *t;
  }

  bool wait(const OpKey& key, int world_size, double max_wait_s) {
    const auto max_wait = std::chrono::duration_cast<Clock::duration>(
        std::chrono::duration<double>(max_wait_s));
    std::unique_lock<std::mutex> lock(mu_);
    forget_abandoned();
    std::shared_ptr<Gang>& slot = gangs_[key];
    if (!slot) slot = std::make_shared<Gang>();
    std::shared_ptr<Gang> gang = slot;
    gang->last_arrival = Clock::now();
    if (++gang->arrived >= world_size) {
      gangs_.erase(key);
      gang->cv.notify_all();
      return true;
    }
    // The groups of a multi-axis mesh run the same operation side by side,
    // so the gathering operation is named without its group.
    const std::pair<int64_t, int64_t> op{key.run_id, key.op_id};
    if (gathering_ && *gathering_ != op) return false;
    gathering_ = op;
    ++waiters_;
    ++gang->waiting;
    const bool all = gang->cv.wait_until(lock, Clock::now() + max_wait, [&] {
      return gang->arrived >= world_size;
    });
    --gang->waiting;
    if (--waiters_ == 0) gathering_.reset();
    return all;
  }

  int64_t pending() {
    std::lock_guard<std::mutex> lock(mu_);
    return static_cast<int64_t>(gangs_.size());
  }

 private:
  // A rank that never comes (a failed run) leaves its operation behind.
  void forget_abandoned() {
    const auto now = Clock::now();
    for (auto it = gangs_.begin(); it != gangs_.end();) {
      if (it->second->waiting == 0 &&
          now > it->second->last_arrival + kForgetAfter) {
        it = gangs_.erase(it);
      } else {
        ++it;
      }
    }
  }

  std::mutex mu_;
  std::map<OpKey, std::shared_ptr<Gang>> gangs_;
  std::optional<std::pair<int64_t, int64_t>> gathering_;  // (run id, op id)
  int waiters_ = 0;
};

}  // namespace

bool gang_start_wait(const OpKey& key, int world_size, double max_wait_s) {
  return GangTable::get().wait(key, world_size, max_wait_s);
}

int64_t gang_start_pending() { return GangTable::get().pending(); }

}  // namespace jaxring
