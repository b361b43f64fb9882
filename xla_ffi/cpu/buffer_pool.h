// Host buffers for split-phase allreduces, reused from step to step.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

namespace jaxring {

// Returns a buffer to the pool when its owner lets go of it.
struct PooledDeleter {
  size_t bytes = 0;
  void operator()(char* p) const;
};
using PooledBuffer = std::unique_ptr<char[], PooledDeleter>;

// A buffer of `bytes` (at least one byte is allocated). A split-phase start
// needs a buffer the size of its bucket that outlives XLA's operands, and a
// train step asks for the same sizes every step. A fresh allocation of that
// size is fresh memory from the kernel: every page faults and is zeroed
// again, a cost that competes with the step's compute for the same cores.
// So released buffers are kept, by exact size, up to kMaxPooledBytes in all.
PooledBuffer acquire_buffer(size_t bytes);

constexpr int64_t kMaxPooledBytes = int64_t{1} << 30;

// Bytes held by the pool now (for tests).
int64_t pooled_bytes();

}  // namespace jaxring
