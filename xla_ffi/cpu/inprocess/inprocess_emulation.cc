// Link emulation in one process: the workers move the data of any plan
// (the flat ring in pipelines of chunks, others ring by ring) and the ranks
// then wait for the modelled links' clock (see run_emulated).
#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

#include "reduce.h"
#include "cpu/inprocess/inprocess_op.h"
#include "cpu/inprocess/link_pacing.h"

namespace jaxring::inprocess {

namespace {

// Link emulation's model: when the modelled links would have delivered each
// unit of the plan. A unit leaves its sender when the sender has its data
// (it entered the unit's phase, for the first step of a chunk; else it
// received the unit before) and is booked on the link it crosses
// (paced_arrival_ns: one per sender with one tier, one per group of the
// tier below with several). The receiver takes it once it arrived and the
// receiver entered the phase; a rank enters phase j + 1 of a ring once it
// took every unit of phase j there, as the plan executor does. Units are
// booked phase by phase, unit by unit, each for all rings and ranks, which
// is an order in which the data can move. Returns, per rank, when it has
// taken its last unit. Arithmetic only: the data moves in move_pipeline and
// move_ring.
std::vector<int64_t> emulated_finish_times(const Op& op) {
  const TieredPlan& plan = op.plan;
  const int p = op.desc.world_size;
  const int rings = plan.num_rings();
  const int64_t esize = plan.elem_bytes();
  auto at = [p](int r, int rank) { return static_cast<size_t>(r * p + rank); };
  // entered[at(r, rank)]: when the rank entered the current phase of ring r.
  std::vector<int64_t> entered(static_cast<size_t>(rings * p));
  for (int r = 0; r < rings; ++r) {
    for (int rank = 0; rank < p; ++rank)
      entered[at(r, rank)] = op.slots[rank].joined_ns;
  }
  for (int j = 0; j < plan.num_phases(); ++j) {
    const int steps = plan.phase(j).num_steps;
    // took[at(r, rank)][u]: when the rank took unit u of this phase.
    std::vector<std::vector<int64_t>> took(entered.size());
    int64_t longest = 0;
    for (int r = 0; r < rings; ++r) {
      for (int rank = 0; rank < p; ++rank) {
        took[at(r, rank)].assign(plan.num_units(r, j, rank),
                                 entered[at(r, rank)]);
        longest = std::max<int64_t>(longest, took[at(r, rank)].size());
      }
    }
    for (int64_t u = 0; u < longest; ++u) {
      for (int r = 0; r < rings; ++r) {
        for (int rank = 0; rank < p; ++rank) {
          std::vector<int64_t>& mine = took[at(r, rank)];
          if (u >= static_cast<int64_t>(mine.size())) continue;
          const Span span = plan.recv_span(r, j, rank, u);
          if (span.count <= 0) continue;  // nothing sent: taken on entry
          const int prev = plan.prev_rank(r, j, rank);
          const std::vector<int64_t>& theirs = took[at(r, prev)];
          // The chunk's first step sends what the sender had on entering
          // the phase; a later one what it took at the step before.
          const int64_t ready =
              u % steps == 0 || u - 1 >= static_cast<int64_t>(theirs.size())
                  ? entered[at(r, prev)]
                  : theirs[u - 1];
          const int64_t arrived = paced_arrival_ns(
              op.desc, op.key.group, prev, rank, span.count * esize, ready);
          mine[u] = std::max(arrived, entered[at(r, rank)]);
        }
      }
    }
    for (size_t i = 0; i < took.size(); ++i) {
      for (int64_t t : took[i]) entered[i] = std::max(entered[i], t);
    }
  }
  std::vector<int64_t> finish(p);
  for (int rank = 0; rank < p; ++rank) {
    finish[rank] = op.slots[rank].joined_ns;
    for (int r = 0; r < rings; ++r) {
      finish[rank] = std::max(finish[rank], entered[at(r, rank)]);
    }
  }
  return finish;
}

// The flat ring: moves the data of pipeline k, one chunk of one ring
// through all its steps at every rank, step by step, so each unit's input
// already exists. Chunks of different rings or indices cover different
// elements, so pipelines can run on different threads at once.
void move_pipeline(Op& op, int64_t k) {
  int r = 0;
  while (k >= op.chunks(r)) k -= op.chunks(r++);
  const int steps = op.steps();
  for (int t = 0; t < steps; ++t) {
    for (int rank = 0; rank < op.desc.world_size; ++rank) {
      run_unit(op, r, rank, k * steps + t);
    }
  }
}

// Any other plan (tiered, exchange): moves ring r's data through every
// phase, with the plan executor's operands and summation order, so the
// bits are the executor's. Why a copy of each rank's own contribution per
// phase: a reduce step adds it to what came, and in an exchange both
// partners write the range the other reads. Within a phase, step by step:
// a step reads what the senders wrote at the step before (or their own
// contribution, at a chunk's first step), never what any rank writes in
// the same step, so the ranks can go one after the other.
void move_ring(Op& op, int r) {
  const TieredPlan& plan = op.plan;
  const int p = op.desc.world_size;
  const int64_t esize = plan.elem_bytes();
  if (plan.num_phases() == 0) {  // a world of one: its input is the sum
    if (r == 0 && op.slots[0].in != op.slots[0].out) {
      std::memcpy(op.slots[0].out, op.slots[0].in,
                  static_cast<size_t>(op.desc.count * esize));
    }
    return;
  }
  const Span part = plan.shard(r, 0, 0);
  if (part.count <= 0) return;
  const int64_t part_bytes = part.count * esize;
  std::unique_ptr<char[]> own_copies(
      new char[static_cast<size_t>(p * part_bytes)]);
  auto own = [&](int rank, int64_t offset) {
    return own_copies.get() + rank * part_bytes +
           (offset - part.offset) * esize;
  };
  auto out = [&](int rank, int64_t offset) {
    return static_cast<char*>(op.slots[rank].out) + offset * esize;
  };
  for (int j = 0; j < plan.num_phases(); ++j) {
    const Phase& ph = plan.phase(j);
    for (int rank = 0; rank < p; ++rank) {
      // The input, copied even in phase 0: it may be the output buffer.
      const Span s = j == 0 ? part : plan.shard(r, j, rank);
      const char* from = j == 0 ? static_cast<const char*>(op.slots[rank].in) +
                                      s.offset * esize
                                : out(rank, s.offset);
      if (ph.kind != PhaseKind::kAllGather && s.count > 0) {
        std::memcpy(own(rank, s.offset), from,
                    static_cast<size_t>(s.count * esize));
      }
    }
    int64_t chunks = 0;
    for (int rank = 0; rank < p; ++rank) {
      chunks = std::max(chunks, plan.num_chunks(r, j, rank));
    }
    for (int t = 0; t < ph.num_steps; ++t) {
      for (int64_t c = 0; c < chunks; ++c) {
        const int64_t u = c * ph.num_steps + t;
        for (int rank = 0; rank < p; ++rank) {
          if (u >= plan.num_units(r, j, rank)) continue;
          const Span span = plan.recv_span(r, j, rank, u);
          if (span.count <= 0) continue;
          const int prev = plan.prev_rank(r, j, rank);
          const char* came = t == 0 && ph.kind != PhaseKind::kAllGather
                                 ? own(prev, span.offset)
                                 : out(prev, span.offset);
          char* dst = out(rank, span.offset);
          if (plan.is_reduce_unit(j, u)) {
            const char* mine = own(rank, span.offset);
            if (plan.own_first(j, rank)) {
              reduce(op.desc.type, op.desc.op, dst, mine, came, span.count);
            } else {
              reduce(op.desc.type, op.desc.op, dst, came, mine, span.count);
            }
          } else {
            std::memcpy(dst, came, static_cast<size_t>(span.count * esize));
          }
        }
      }
    }
  }
}

void move_share(Op& op, int64_t pipeline) {
  if (op.flat) {
    move_pipeline(op, pipeline);
  } else {
    move_ring(op, static_cast<int>(pipeline));
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
  // the workers move the data in shares of whole pipelines (of whole rings,
  // for a plan other than the flat ring), then sleep until the model's
  // clock says the link delivered. The data and its summation order are
  // those of the plan, bit for bit.
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
    const int64_t end =
        std::min(first + op.pipelines_per_share, op.num_pipelines);
    for (int64_t pipeline = first; pipeline < end; ++pipeline) {
      move_share(op, pipeline);
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
