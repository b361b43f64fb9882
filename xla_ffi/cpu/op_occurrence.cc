#include "cpu/op_occurrence.h"

#include <map>
#include <mutex>
#include <tuple>
#include <unordered_map>

namespace jaxring {

namespace {

// Counts per run, for the runs used most recently: a run id is new at every
// execution, and a run that ended is never seen again, so the least recently
// used run is dropped past kMaxRuns. A run still looping uses its counts at
// every iteration; it would have to wait while kMaxRuns others run for its
// counts to go.
constexpr size_t kMaxRuns = 256;

struct RunCounts {
  std::map<std::tuple<int64_t, int64_t, int>, int64_t>
      next;  // (op, group, rank)
  uint64_t last_use = 0;
};

std::mutex& counts_mu() {
  static auto* mu = new std::mutex();
  return *mu;
}
std::unordered_map<int64_t, RunCounts>& counts() {
  static auto* c = new std::unordered_map<int64_t, RunCounts>();
  return *c;
}

}  // namespace

OpKey next_occurrence(const OpKey& key, int rank) {
  int64_t n;
  {
    std::lock_guard<std::mutex> lock(counts_mu());
    static uint64_t tick = 0;
    auto& runs = counts();
    RunCounts& run = runs[key.run_id];
    run.last_use = ++tick;
    n = run.next[{key.op_id, key.group, rank}]++;
    if (runs.size() > kMaxRuns) {
      auto oldest = runs.begin();
      for (auto it = runs.begin(); it != runs.end(); ++it) {
        if (it->second.last_use < oldest->second.last_use) oldest = it;
      }
      runs.erase(oldest);  // never this run: it was used last
    }
  }
  if (n == 0) return key;
  OpKey k = key;
  k.op_id =
      static_cast<int64_t>(static_cast<uint64_t>(key.op_id) ^
                           (static_cast<uint64_t>(n) * 0x9E3779B97F4A7C15ull));
  return k;
}

}  // namespace jaxring
