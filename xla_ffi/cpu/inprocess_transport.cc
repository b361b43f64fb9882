#include "inprocess_transport.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <thread>
#include <vector>

#include "../failure.h"
#include "../plan.h"
#include "huge_pages.h"
#include "task_queue.h"
#include "timeline.h"

namespace jaxring {

namespace {

using Clock = std::chrono::steady_clock;

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             Clock::now().time_since_epoch())
      .count();
}

// How long an idle worker sleeps before it rechecks deadlines.
constexpr auto kDeadlinePoll = std::chrono::milliseconds(20);
constexpr int kYieldsBeforeSleep = 64;
// The direct algorithm reduces its segment this many bytes at a time, so the
// accumulator stays in cache between the p reads and the p writes.
constexpr int64_t kDirectPieceBytes = 64 << 10;
// Under link emulation, the data of an operation is cut into shares of at
// least this many bytes of every rank's buffer for the workers to take.
constexpr int64_t kMinShareBytes = 8 << 20;

class Worker;

// One rank's slot in an operation.
struct RankSlot {
  std::atomic<bool> joined{false};
  std::atomic<bool> finished{false};
  // Set once a rank has stopped touching peers' buffers after a failure.
  std::atomic<bool> stopped{false};
  const void* in = nullptr;
  void* out = nullptr;
  Worker* worker = nullptr;
  // progress[r]: units (chunk, step) of ring r this rank has completed, in
  // the plan's chunk-major order.
  std::unique_ptr<std::atomic<int64_t>[]> progress;
  // When this rank joined (its data exists from then on).
  int64_t joined_ns = 0;
};

struct Op {
  Op(const OpKey& k, const OpDesc& d, double timeout_s)
      : key(k),
        desc(d),
        plan(d.world_size, d.num_rings, d.count, elem_bytes(d.type),
             d.chunk_bytes),
        slots(d.world_size),
        deadline(Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                    std::chrono::duration<double>(timeout_s))),
        timeout_s(timeout_s) {
    int64_t units = 0;
    for (int r = 0; r < d.num_rings; ++r) {
      unit_base.push_back(units);
      units += plan.num_chunks(r) * plan.num_steps();
    }
    num_units = units;
    for (int r = 0; r < d.num_rings; ++r) num_pipelines += plan.num_chunks(r);
    // A share is worth handing to another thread only if it is a few
    // milliseconds of copying: a worker woken for less may wait longer for
    // a core than the work takes.
    const int64_t bytes = d.count * elem_bytes(d.type);
    const int64_t per_pipeline = bytes / std::max<int64_t>(num_pipelines, 1);
    pipelines_per_share = std::max<int64_t>(
        1, (kMinShareBytes + per_pipeline - 1) / std::max<int64_t>(per_pipeline, 1));
    parts_left.store(num_shares() + 1);
    for (auto& s : slots) {
      s.progress.reset(new std::atomic<int64_t>[d.num_rings]);
      for (int r = 0; r < d.num_rings; ++r) s.progress[r].store(0);
    }
  }

  bool emulated() const { return desc.emulated(); }
  bool direct() const { return desc.algorithm == Algorithm::kDirect; }

  const OpKey key;
  const OpDesc desc;
  const RingPlan plan;
  std::vector<int64_t> unit_base;  // index of ring r's first unit
  int64_t num_units = 0;           // units of all rings, per rank
  std::vector<RankSlot> slots;
  const Clock::time_point deadline;
  const double timeout_s;
  std::atomic<int> joined_count{0};
  std::atomic<int> finished_count{0};
  std::atomic<bool> failed{false};
  std::mutex error_mu;
  std::string error;
  // Link emulation (see run_emulated). The work is the timing (one part)
  // and the data, cut into shares of whole pipelines; `parts_left` counts
  // down as parts end, and whoever ends the last sets data_done, after which
  // finish_ns (written by the timing part) may be read.
  std::atomic<bool> timing_claimed{false};
  std::atomic<int64_t> next_share{0};
  std::atomic<int64_t> parts_left{-1};  // set when the op is created
  std::atomic<bool> data_done{false};
  std::vector<int64_t> finish_ns;
  int64_t num_pipelines = 0;       // chunks of all rings
  int64_t pipelines_per_share = 1;
  int64_t num_shares() const {
    return (num_pipelines + pipelines_per_share - 1) / pipelines_per_share;
  }

  void fail(const std::string& why) {
    {
      std::lock_guard<std::mutex> lock(error_mu);
      if (failed.load()) return;
      error = why;
      failed.store(true);
    }
    wake_all();
  }
  std::string error_message() {
    std::lock_guard<std::mutex> lock(error_mu);
    return error;
  }
  void wake_all();
  // Comma-separated ranks whose flag (joined, finished) is not yet set.
  std::string ranks_without(std::atomic<bool> RankSlot::*flag) const {
    std::ostringstream os;
    const char* sep = "";
    for (int r = 0; r < desc.world_size; ++r) {
      if (!(slots[r].*flag).load()) {
        os << sep << r;
        sep = ", ";
      }
    }
    return os.str();
  }
  std::string name() const {
    std::ostringstream os;
    os << "jaxring allreduce (op " << key.op_id << ", group " << key.group
       << ", run " << key.run_id << ", " << desc.describe() << ")";
    return os.str();
  }
};

// One rank's pending part of an operation, held by that rank's worker.
struct Task {
  std::shared_ptr<Op> op;
  int rank;
  Completion done;
  std::vector<int64_t> cursor;  // per ring: next unit to run
  // Link emulation: when the modelled link delivers this rank's last unit,
  // if that is still in the future (advance() sets it; -1: not waiting).
  int64_t wake_ns = -1;
};

// A thread per device that advances its tasks.
class Worker {
 public:
  explicit Worker(int device) : device_(device) {
    // Workers live for the whole process: XLA may still be running a
    // program during interpreter shutdown, and a worker destroyed under it
    // would turn a clean exit into a crash.
    std::thread([this] { loop(); }).detach();
  }

  void submit(Task task) { queue_.submit(std::move(task)); }
  void wake() { queue_.wake(); }

  // Books a transfer of `bytes` leaving this device once its data is ready
  // at ready_ns, on the device's one emulated link; returns its arrival.
  int64_t book_transfer(int64_t ready_ns, int64_t bytes, const OpDesc& d) {
    std::lock_guard<std::mutex> lock(egress_mu_);
    const int64_t start = std::max(ready_ns, egress_free_ns_);
    // This path runs flat rings on one link (ring_transport.cc).
    const EmulatedTier& link = d.link.front();
    const int64_t busy = static_cast<int64_t>(1e9 * bytes / link.bytes_per_s);
    egress_free_ns_ = start + busy;
    return start + busy + static_cast<int64_t>(1e9 * link.latency_s);
  }

 private:
  void loop() {
    std::list<Task> active;
    for (;;) {
      const uint64_t seen = queue_.collect(active);
      bool progressed = false;
      int64_t wake_ns = -1;  // earliest emulated delivery still to come
      for (auto it = active.begin(); it != active.end();) {
        bool finished = false;
        progressed |= advance(*it, &finished);
        if (finished) {
          it = active.erase(it);
        } else {
          if (it->wake_ns >= 0 && (wake_ns < 0 || it->wake_ns < wake_ns)) {
            wake_ns = it->wake_ns;
          }
          ++it;
        }
      }
      if (!progressed && !active.empty()) {
        auto until = Clock::now() + kDeadlinePoll;
        if (wake_ns >= 0) {
          // Waiting on the emulated link: sleep, do not spin, so that the
          // wait costs wall time but no CPU.
          until = std::min(until, Clock::time_point(std::chrono::nanoseconds(wake_ns)));
        } else {
          // A peer is usually a few microseconds from its next chunk: yield
          // a little before paying for a sleep and a wake-up.
          for (int i = 0; i < kYieldsBeforeSleep && !queue_.changed(seen); ++i) {
            std::this_thread::yield();
          }
        }
        queue_.wait_until(seen, until);
      }
    }
  }

  // Runs what the task can run now. Returns whether anything happened; sets
  // *finished once the task's completion has been called.
  bool advance(Task& task, bool* finished);
  // The direct algorithm's whole part for one rank, once every rank is here.
  bool run_direct(Task& task);
  // Link emulation: once every rank is here, the workers move the data in
  // pipelines (run_pipeline), one of them computes the modelled link's
  // times (emulated_finish_times), and each rank then waits for its time.
  bool run_emulated(Task& task);

  std::vector<char> scratch_;  // the direct algorithm's accumulator

  const int device_;
  TaskQueue<Task> queue_;
  std::mutex egress_mu_;
  int64_t egress_free_ns_ = 0;  // when this device's emulated link is free
};

void Op::wake_all() {
  for (auto& s : slots) {
    if (s.joined.load(std::memory_order_acquire) && s.worker) s.worker->wake();
  }
}

// Moves the data of unit `cur` of ring r at `rank`: reduces (or copies) the
// chunk the plan says it receives from its neighbour into its output. The
// caller guarantees the neighbour has done the unit before it.
void run_unit(Op& op, int r, int rank, int64_t cur) {
  const RingPlan& plan = op.plan;
  const int steps = plan.num_steps();
  const int64_t esize = plan.elem_bytes();
  const int64_t c = cur / steps;
  const int t = static_cast<int>(cur % steps);
  const RankSlot& from = op.slots[plan.prev_rank(r, rank)];
  const RankSlot& me = op.slots[rank];
  const Span span = plan.chunk(r, plan.recv_segment(plan.position(r, rank), t), c);
  if (span.count <= 0) return;
  char* dst = static_cast<char*>(me.out) + span.offset * esize;
  if (plan.is_reduce_step(t)) {
    // Step 0 starts from the neighbour's input; later steps from the partial
    // result it wrote at the step before.
    const char* src = static_cast<const char*>(t == 0 ? from.in : from.out) +
                      span.offset * esize;
    const char* mine = static_cast<const char*>(me.in) + span.offset * esize;
    reduce(op.desc.type, op.desc.op, dst, src, mine, span.count);
  } else {
    const char* src = static_cast<const char*>(from.out) + span.offset * esize;
    std::memcpy(dst, src, span.count * esize);
  }
}

// Link emulation's model: when a link of the modelled bandwidth and latency
// would have delivered each unit. A unit leaves its sender when the sender
// has its data (it joined, or received the unit before) and the sender's one
// outgoing link is free; transfers queue on that link in the order they are
// booked. Units are booked in the plan's order (unit by unit, each for all
// rings and ranks), which is also an order in which the data can move.
// Returns, per rank, when its last unit arrives. Arithmetic only: the data
// moves in run_pipeline.
std::vector<int64_t> emulated_finish_times(const Op& op) {
  const RingPlan& plan = op.plan;
  const int p = op.desc.world_size;
  const int steps = plan.num_steps();
  const int64_t esize = plan.elem_bytes();
  // done_ns[rank * num_units + unit]: when the unit had arrived at the rank.
  std::vector<int64_t> done_ns(static_cast<size_t>(p * op.num_units), 0);
  std::vector<int64_t> finish(p);
  int64_t longest = 0;
  for (int rank = 0; rank < p; ++rank) finish[rank] = op.slots[rank].joined_ns;
  for (int r = 0; r < plan.num_rings(); ++r) {
    longest = std::max(longest, plan.num_chunks(r) * steps);
  }
  for (int64_t cur = 0; cur < longest; ++cur) {
    const int t = static_cast<int>(cur % steps);
    for (int r = 0; r < plan.num_rings(); ++r) {
      if (cur >= plan.num_chunks(r) * steps) continue;
      const int64_t unit = op.unit_base[r] + cur;
      for (int rank = 0; rank < p; ++rank) {
        const int prev = plan.prev_rank(r, rank);
        const RankSlot& from = op.slots[prev];
        const int64_t ready =
            t == 0 ? from.joined_ns : done_ns[prev * op.num_units + unit - 1];
        const Span span = plan.chunk(
            r, plan.recv_segment(plan.position(r, rank), t), cur / steps);
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
  const RingPlan& plan = op.plan;
  int r = 0;
  while (k >= plan.num_chunks(r)) k -= plan.num_chunks(r++);
  const int steps = plan.num_steps();
  for (int t = 0; t < steps; ++t) {
    for (int rank = 0; rank < op.desc.world_size; ++rank) {
      run_unit(op, r, rank, k * steps + t);
    }
  }
}

bool Worker::advance(Task& task, bool* finished) {
  Op& op = *task.op;
  RankSlot& me = op.slots[task.rank];
  const RingPlan& plan = op.plan;
  const int steps = plan.num_steps();
  task.wake_ns = -1;

  if (op.failed.load(std::memory_order_acquire)) {
    if (!me.stopped.exchange(true)) op.wake_all();
    // Complete only once no joined rank can still be reading our buffers.
    for (auto& s : op.slots) {
      if (s.joined.load() && !s.stopped.load() && !s.finished.load()) {
        return false;
      }
    }
    task.done(op.error_message());
    *finished = true;
    return true;
  }

  bool progressed = false;
  if (!me.finished.load(std::memory_order_relaxed) && op.direct()) {
    progressed = run_direct(task);
  } else if (!me.finished.load(std::memory_order_relaxed) && op.emulated()) {
    progressed = run_emulated(task);
  } else if (!me.finished.load(std::memory_order_relaxed)) {
    bool all_rings_done = true;
    for (int r = 0; r < plan.num_rings(); ++r) {
      const int64_t total = plan.num_chunks(r) * steps;
      RankSlot& from = op.slots[plan.prev_rank(r, task.rank)];
      int64_t& cur = task.cursor[r];
      while (cur < total) {
        const int64_t c = cur / steps;
        const int t = static_cast<int>(cur % steps);
        if (!from.joined.load(std::memory_order_acquire)) break;
        // Chunk c of step t needs the neighbour's chunk c of step t-1.
        if (t > 0 &&
            from.progress[r].load(std::memory_order_acquire) < c * steps + t) {
          break;
        }
        run_unit(op, r, task.rank, cur);
        ++cur;
        me.progress[r].store(cur, std::memory_order_release);
        progressed = true;
        RankSlot& to = op.slots[plan.next_rank(r, task.rank)];
        if (to.joined.load(std::memory_order_acquire)) to.worker->wake();
      }
      if (cur < total) all_rings_done = false;
    }
    if (all_rings_done) {
      me.finished.store(true, std::memory_order_release);
      op.finished_count.fetch_add(1);
      op.wake_all();
      progressed = true;
    }
  }

  // Once every rank has finished, no one touches this rank's buffers. Under
  // emulation, all the data had moved before any rank finished.
  if (op.finished_count.load() == op.desc.world_size ||
      (op.emulated() && me.finished.load(std::memory_order_acquire))) {
    if (timeline_enabled()) {
      timeline_record({device_, op.key.run_id, op.key.op_id,
                       op.desc.count * plan.elem_bytes(), op.desc.num_rings,
                       me.joined_ns, now_ns()});
    }
    task.done(std::nullopt);
    *finished = true;
    return true;
  }
  // Moving the data is bounded work on buffers every rank still holds: no
  // timeout while it runs.
  const bool executing = op.timing_claimed.load() && !op.data_done.load();
  if (!progressed && !executing && Clock::now() > op.deadline) {
    std::ostringstream os;
    os << op.name() << " timed out after " << op.timeout_s << " s: ";
    const std::string missing = op.ranks_without(&RankSlot::joined);
    if (!missing.empty()) {
      os << "rank(s) " << missing << " of " << op.desc.world_size
         << " never arrived. Every device must run the same allreduces; a "
            "device program that never starts usually means the CPU thread "
            "pool is exhausted (see JAXRING_CPU_THREADS) or a rank took a "
            "different branch.";
    } else {
      os << "rank(s) " << op.ranks_without(&RankSlot::finished) << " did not finish.";
    }
    op.fail(tagged(FailureKind::kTimeout, -1, os.str()));
  }
  return progressed;
}

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

bool Worker::run_direct(Task& task) {
  Op& op = *task.op;
  const int p = op.desc.world_size;
  // Acquire: every slot's buffers were published before its join was counted.
  if (op.joined_count.load(std::memory_order_acquire) < p) return false;
  const int64_t esize = elem_bytes(op.desc.type);
  const Span mine = even_split(op.desc.count, p, task.rank);
  const int64_t piece = std::max<int64_t>(1, kDirectPieceBytes / esize);
  scratch_.resize(static_cast<size_t>(std::min(piece, std::max<int64_t>(mine.count, 1)) * esize));
  char* acc = scratch_.data();
  for (int64_t begin = mine.offset; begin < mine.offset + mine.count; begin += piece) {
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

class Registry {
 public:
  static Registry& get() {
    // Leaked on purpose: see Worker.
    static Registry* r = new Registry();
    return *r;
  }

  Worker* worker(int device) {
    std::lock_guard<std::mutex> lock(mu_);
    auto& w = workers_[device];
    if (!w) w.reset(new Worker(device));
    return w.get();
  }

  // Returns the op for key, creating it; an error if desc disagrees or the
  // rank has already joined.
  std::shared_ptr<Op> join(const OpKey& key, const OpDesc& desc, int rank,
                           const void* in, void* out, Worker* worker,
                           double timeout_s, std::string* error) {
    std::lock_guard<std::mutex> lock(mu_);
    collect_garbage();
    auto& slot = ops_[key];
    if (!slot) slot = std::make_shared<Op>(key, desc, timeout_s);
    std::shared_ptr<Op> op = slot;
    if (!(op->desc == desc)) {
      std::ostringstream os;
      os << op->name() << ": rank " << rank << " called with "
         << desc.describe() << " but an earlier rank used "
         << op->desc.describe()
         << ". Every rank must pass the same shape, dtype and op.";
      *error = tagged(FailureKind::kMismatch, -1, os.str());
      op->fail(*error);
      return nullptr;
    }
    RankSlot& s = op->slots[rank];
    if (s.joined.load()) {
      std::ostringstream os;
      os << op->name() << ": rank " << rank
         << " joined twice (two devices computed the same rank).";
      *error = tagged(FailureKind::kInternal, -1, os.str());
      op->fail(*error);
      return nullptr;
    }
    advise_huge_pages(out, desc.count * elem_bytes(desc.type));
    s.in = in;
    s.out = out;
    s.worker = worker;
    s.joined_ns = now_ns();
    s.joined.store(true, std::memory_order_release);
    if (op->joined_count.fetch_add(1) + 1 == desc.world_size) {
      ops_.erase(key);  // everyone is here; the key is free again
    }
    op->wake_all();
    return op;
  }

  int64_t pending() {
    std::lock_guard<std::mutex> lock(mu_);
    return static_cast<int64_t>(ops_.size());
  }

 private:
  // An op whose ranks never all arrived stays so that latecomers fail fast
  // with its error; it is dropped a timeout after its deadline.
  void collect_garbage() {
    const auto now = Clock::now();
    for (auto it = ops_.begin(); it != ops_.end();) {
      const auto grace = std::chrono::duration_cast<Clock::duration>(
          std::chrono::duration<double>(it->second->timeout_s));
      if (it->second->failed.load() && now > it->second->deadline + grace) {
        it = ops_.erase(it);
      } else {
        ++it;
      }
    }
  }

  std::mutex mu_;
  std::map<int, std::unique_ptr<Worker>> workers_;
  std::map<OpKey, std::shared_ptr<Op>> ops_;
};

}  // namespace

void inprocess_allreduce(const OpKey& key, const OpDesc& desc, int rank,
                         int device, const void* in, void* out,
                         double timeout_s, Completion done) {
  Registry& reg = Registry::get();
  Worker* worker = reg.worker(device);
  std::string error;
  std::shared_ptr<Op> op =
      reg.join(key, desc, rank, in, out, worker, timeout_s, &error);
  if (!op) {
    done(error);
    return;
  }
  Task task{std::move(op), rank, std::move(done),
            std::vector<int64_t>(desc.num_rings, 0)};
  worker->submit(std::move(task));
}

int64_t inprocess_pending_ops() { return Registry::get().pending(); }

}  // namespace jaxring
