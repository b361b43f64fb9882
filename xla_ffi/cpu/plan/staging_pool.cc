#include "cpu/plan/staging_pool.h"

#include <algorithm>

namespace jaxring {

StagingPool& StagingPool::get() {
  // Leaked on purpose: worker and I/O threads may use it during interpreter
  // shutdown.
  static StagingPool* p = new StagingPool();
  return *p;
}

std::unique_ptr<char[]> StagingPool::take(size_t n) {
  in_use_ += static_cast<int64_t>(n);
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = free_.find(n);
    if (it != free_.end()) {
      std::unique_ptr<char[]> b = std::move(it->second);
      free_.erase(it);
      held_ -= n;
      return b;
    }
  }
  return std::unique_ptr<char[]>(new char[std::max<size_t>(n, 1)]);
}

void StagingPool::give(size_t n, std::unique_ptr<char[]> b) {
  in_use_ -= static_cast<int64_t>(n);
  std::lock_guard<std::mutex> lock(mu_);
  if (held_ + n > kMaxHeld) return;  // freed here
  held_ += n;
  free_.emplace(n, std::move(b));
}

}  // namespace jaxring
