// Link emulation in one process: the workers move the data in pipelines
// and the ranks then wait for a modelled link's clock (see run_emulated).
#include <algorithm>
#include <vector>

#include "inprocess_op.h"

namespace jaxring::inprocess {

namespace {

// Link emulation's model: when a link of the modelled bandwidth and latency
// would have delivered each unit. A unit leaves its sender when the sender
// has its data (it joined, or received the unit before) and the sender's one
// outgoing link is free; transfers queue on that link in the order they are
// booked. Units are booked in the plan's order (unit by unit, each for all
// rings and ranks), which is also an order in which the data can move.
// Returns, per rank, when its last unit arrives. Arithmetic only: the data
// moves in run_pipeline.
std::vector<int64_t> emulated_finish_times(const Op& op) {
  const TieredPlan& plan = op.plan;
  const int p = op.desc.world_size;
  const int steps = op.steps();
  const int64_t esize = plan.elem_bytes();
  // done_ns[rank * num_units + unit]: when the unit had arrived at the rank.
  std::vector<int64_t> done_ns(static_cast<size_t>(p * op.num_units), 0);
  std::vector<int64_t> finish(p);
  int64_t longest = 0;
  for (int rank = 0; rank < p; ++rank) finish[rank] = op.slots[rank].joined_ns;
  for (int r = 0; r < plan.num_rings(); ++r) {
    longest = std::max(longest, op.chunks(r) * steps);
  }
  for (int64_t cur = 0; cur < longest; ++cur) {
    const int t = static_cast<int>(cur % steps);
    for (int r = 0; r < plan.num_rings(); ++r) {
      if (cur >= op.chunks(r) * steps) continue;
      const int64_t unit = op.unit_base[r] + cur;
      for (int rank = 0; rank < p; ++rank) {
        const int prev = op.prev_rank(r, rank);
        const RankSlot& from = op.slots[prev];
        const int64_t ready =
            t == 0 ? from.joined_ns : done_ns[prev * op.num_units + unit - 1];
        const Span span = plan.recv_span(r, 0, rank, cur);
        int64_t arrived =
            from.worker->book_transfer(ready, span.count * esize, op.desc);
        // A rank takes its units in order, and only once it has joined.
        arrived = std::max(arrived, op.slots[rank].joined_ns);
        if (cur > 0) {
          arrived = std::max(arrived, done_ns[rank * op.num_units + unit - 1]);
        }
        done_ns[rank * op.num_units + unit] = arrived;
        finish[rank] = std::max(finish[rank], arrived);
      }
    }
  }
  return finish;
}

// Moves the data of pipeline k, one chunk of one ring through all its steps
// at every rank, step by step, so each unit's input already exists. Chunks
// of different rings or indices cover different elements, so pipelines can
// run on different threads at once.
void run_pipeline(Op& op, int64_t k) {
  int r = 0;
  while (k >= op.chunks(r)) k -= op.chunks(r++);
  const int steps = op.steps();
  for (int t = 0; t < steps; ++t) {
    for (int rank = 0; rank < op.desc.world_size; ++rank) {
      run_unit(op, r, rank, k * steps + t);
    }
  }
}

}  // namespace

bool Worker::run_emulated(Task& task) {
  Op& op = *task.op;
  // Acquire: every slot's buffers were published before its join was counted.
  if (op.joined_count.load(std::memory_order_acquire) < op.desc.world_size) {
    return false;
  }
  // Why not a worker per rank stepping through the ring, each waiting for
  // the link's arrivals: a ring step waits for the neighbour's worker, so
  // each of the 2(p-1) steps costs two thread wake-ups per rank. While the
  // devices compute, each wake-up waits for a core: a bucket worth 5 ms on
  // the link took 60 ms, and the wake-ups cost more CPU than the data. Here
  // the workers move the data in shares of whole pipelines, then sleep
  // until the model's clock says the link delivered. The data and its
  // summation order are those of the ring, bit for bit.
  bool progressed = false;
  auto part_done = [&op] {
    if (op.parts_left.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      op.data_done.store(true, std::memory_order_release);
      op.wake_all();
    }
  };
  if (!op.timing_claimed.exchange(true)) {
    op.finish_ns = emulated_finish_times(op);
    part_done();
    progressed = true;
  }
  for (int64_t k; (k = op.next_share.fetch_add(1)) < op.num_shares();) {
    const int64_t first = k * op.pipelines_per_share;
    const int64_t end = std::min(first + op.pipelines_per_share, op.num_pipelines);
    for (int64_t pipeline = first; pipeline < end; ++pipeline) {
      run_pipeline(op, pipeline);
    }
    part_done();
    progressed = true;
  }
  if (!op.data_done.load(std::memory_order_acquire)) return progressed;
  const int64_t finish = op.finish_ns[task.rank];
  if (finish > now_ns()) {
    task.wake_ns = finish;  // the worker sleeps until the link delivers
    return progressed;
  }
  RankSlot& me = op.slots[task.rank];
  me.finished.store(true, std::memory_order_release);
  op.finished_count.fetch_add(1);
  return true;
}

}  // namespace jaxring::inprocess
