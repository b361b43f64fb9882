// Buffers for units that arrive before their rank can take them (it has not
// joined, or not reached their phase). They are reused: fresh large
// allocations come as new pages from the kernel, and faulting them in costs
// about as much as receiving into them.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>

namespace jaxring {

class StagingPool {
 public:
  static StagingPool& get();  // process-wide, never destroyed

  std::unique_ptr<char[]> take(size_t n);
  void give(size_t n, std::unique_ptr<char[]> b);
  // Bytes of staged units not yet consumed.
  int64_t in_use() const { return in_use_.load(); }

 private:
  // What the pool keeps for reuse; buffers given back beyond it are freed.
  static constexpr size_t kMaxHeld = size_t{256} << 20;
  std::atomic<int64_t> in_use_{0};
  std::mutex mu_;
  std::multimap<size_t, std::unique_ptr<char[]>> free_;
  size_t held_ = 0;
};

// A staged unit: its bytes and their count (to return them to the pool).
struct Staged {
  Staged() = default;
  explicit Staged(size_t n) : size(n), data(StagingPool::get().take(n)) {}
  Staged(Staged&&) = default;
  Staged& operator=(Staged&& o) {
    release();
    size = o.size;
    data = std::move(o.data);
    from_process = o.from_process;
    return *this;
  }
  ~Staged() { release(); }
  void release() {
    if (data) StagingPool::get().give(size, std::move(data));
  }
  size_t size = 0;
  std::unique_ptr<char[]> data;
  // The process whose connection brought it: checked against the plan once
  // a local rank joins and says which process runs each rank.
  int from_process = -1;
};

}  // namespace jaxring
