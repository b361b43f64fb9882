// The direct algorithm in one process: once every rank is here, each
// reduces its own segment from every rank's input, in rank order, and
// writes it into every rank's output.
#include <algorithm>
#include <cstring>

#include "reduce.h"
#include "cpu/inprocess/inprocess_op.h"

namespace jaxring::inprocess {

// The direct algorithm reduces its segment this many bytes at a time, so the
// accumulator stays in cache between the p reads and the p writes.
constexpr int64_t kDirectPieceBytes = 64 << 10;
bool Worker::run_direct(Task& task) {
  Op& op = *task.op;
  const int p = op.desc.world_size;
  // Acquire: every slot's buffers were published before its join was counted.
  if (op.joined_count.load(std::memory_order_acquire) < p) return false;
  const int64_t esize = elem_bytes(op.desc.type);
  const Span mine = even_split(op.desc.count, p, task.rank);
  const int64_t piece = std::max<int64_t>(1, kDirectPieceBytes / esize);
  scratch_.resize(static_cast<size_t>(
      std::min(piece, std::max<int64_t>(mine.count, 1)) * esize));
  char* acc = scratch_.data();
  for (int64_t begin = mine.offset; begin < mine.offset + mine.count;
       begin += piece) {
    const int64_t n = std::min(piece, mine.offset + mine.count - begin);
    const int64_t at = begin * esize;
    // Always in rank order, so the result does not depend on who reduced it.
    reduce(op.desc.type, op.desc.op, acc,
           static_cast<const char*>(op.slots[0].in) + at,
           static_cast<const char*>(op.slots[1].in) + at, n);
    for (int k = 2; k < p; ++k) {
      reduce(op.desc.type, op.desc.op, acc, acc,
             static_cast<const char*>(op.slots[k].in) + at, n);
    }
    // The accumulator, not an output, holds the partial result: an output
    // may alias its rank's input, which is still to be read.
    for (int k = 0; k < p; ++k) {
      std::memcpy(static_cast<char*>(op.slots[k].out) + at, acc, n * esize);
    }
  }
  RankSlot& me = op.slots[task.rank];
  me.finished.store(true, std::memory_order_release);
  op.finished_count.fetch_add(1);
  op.wake_all();
  return true;
}

}  // namespace jaxring::inprocess
