#include "cpu/buffer_pool.h"

#include <map>
#include <mutex>
#include <vector>

#include "cpu/huge_pages.h"

namespace jaxring {

namespace {

class BufferPool {
 public:
  static BufferPool& get() {
    // Leaked on purpose: a program still running at interpreter exit may
    // release a buffer into it.
    static BufferPool* pool = new BufferPool();
    return *pool;
  }

  char* take(size_t bytes) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = free_.find(bytes);
      if (it != free_.end() && !it->second.empty()) {
        char* p = it->second.back();
        it->second.pop_back();
        held_ -= static_cast<int64_t>(bytes);
        return p;
      }
    }
    char* p = new char[bytes];
    advise_huge_pages(p, static_cast<int64_t>(bytes));
    return p;
  }

  void give(char* p, size_t bytes) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (held_ + static_cast<int64_t>(bytes) <= kMaxPooledBytes) {
        free_[bytes].push_back(p);
        held_ += static_cast<int64_t>(bytes);
        return;
      }
    }
    delete[] p;
  }

  int64_t held() {
    std::lock_guard<std::mutex> lock(mu_);
    return held_;
  }

 private:
  std::mutex mu_;
  std::map<size_t, std::vector<char*>> free_;
  int64_t held_ = 0;
};

}  // namespace

void PooledDeleter::operator()(char* p) const {
  if (p) BufferPool::get().give(p, bytes);
}

PooledBuffer acquire_buffer(size_t bytes) {
  const size_t n = bytes > 0 ? bytes : 1;
  return PooledBuffer(BufferPool::get().take(n), PooledDeleter{n});
}

int64_t pooled_bytes() { return BufferPool::get().held(); }

}  // namespace jaxring
