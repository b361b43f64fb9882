#include "cpu/inprocess/inprocess_transport.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <thread>
#include <vector>

#include "cpu/deadline.h"
#include "failure.h"
#include "reduce.h"
#include "cpu/huge_pages.h"
#include "cpu/inprocess/inprocess_op.h"
#include "cpu/timeline.h"
#include "cpu/worker_loop.h"

namespace jaxring {

namespace inprocess {

constexpr int kYieldsBeforeSleep = 64;

void Worker::loop() {
  run_worker_loop<Task>(
      [this](std::list<Task>& active) { return queue_.collect(active); },
      [this](Task& task, bool* finished) { return advance(task, finished); },
      [this](uint64_t seen, const std::list<Task>& active) {
        idle(seen, active);
      });
}

void Worker::idle(uint64_t seen, const std::list<Task>& active) {
  // An empty list: the next collect() blocks until a task comes.
  if (active.empty()) return;
  int64_t wake_ns = -1;  // earliest emulated delivery still to come
  for (const Task& t : active) {
    if (t.wake_ns >= 0 && (wake_ns < 0 || t.wake_ns < wake_ns)) {
      wake_ns = t.wake_ns;
    }
  }
  auto until = Clock::now() + kDeadlinePoll;
  if (wake_ns >= 0) {
    // Waiting on the emulated link: sleep, do not spin, so that the wait
    // costs wall time but no CPU.
    until =
        std::min(until, Clock::time_point(std::chrono::nanoseconds(wake_ns)));
  } else {
    // A peer is usually a few microseconds from its next chunk: yield a
    // little before paying for a sleep and a wake-up.
    for (int i = 0; i < kYieldsBeforeSleep && !queue_.changed(seen); ++i) {
      std::this_thread::yield();
    }
  }
  queue_.wait_until(seen, until);
}

void Op::wake_all() {
  for (auto& s : slots) {
    if (s.joined.load(std::memory_order_acquire) && s.worker) s.worker->wake();
  }
}

void run_unit(Op& op, int r, int rank, int64_t cur) {
  const TieredPlan& plan = op.plan;
  const int64_t esize = plan.elem_bytes();
  const int t = static_cast<int>(cur % op.steps());
  const RankSlot& from = op.slots[op.prev_rank(r, rank)];
  const RankSlot& me = op.slots[rank];
  const Span span = plan.recv_span(r, 0, rank, cur);
  if (span.count <= 0) return;
  char* dst = static_cast<char*>(me.out) + span.offset * esize;
  if (plan.is_reduce_unit(0, cur)) {
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

bool Worker::advance(Task& task, bool* finished) {
  Op& op = *task.op;
  RankSlot& me = op.slots[task.rank];
  const int steps = op.steps();
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
    for (int r = 0; r < op.desc.num_rings; ++r) {
      const int64_t total = op.chunks(r) * steps;
      RankSlot& from = op.slots[op.prev_rank(r, task.rank)];
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
        RankSlot& to = op.slots[op.next_rank(r, task.rank)];
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
      int64_t last_join = 0;  // every rank joined before any completed
      for (const RankSlot& s : op.slots)
        last_join = std::max(last_join, s.joined_ns);
      timeline_record({device_, op.key.run_id, op.key.op_id,
                       op.desc.count * op.plan.elem_bytes(), op.desc.num_rings,
                       me.joined_ns, now_ns(), last_join});
    }
    task.done(std::nullopt);
    *finished = true;
    return true;
  }
  // Moving the data is bounded work on buffers every rank still holds: no
  // timeout while it runs.
  const bool executing = op.timing_claimed.load() && !op.data_done.load();
  // All ranks run in this program: no peer can be in another one.
  if (!executing && watch_wait(progressed, Clock::now(), op.deadline,
                               /*probe=*/nullptr) == WaitVerdict::kTimedOut) {
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
      os << "rank(s) " << op.ranks_without(&RankSlot::finished)
         << " did not finish.";
    }
    op.fail(tagged(FailureKind::kTimeout, -1, os.str()));
  }
  return progressed;
}

namespace {

// The operations being met, and the worker of each device.
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
    if (!slot) {
      try {
        slot = std::make_shared<Op>(key, desc, timeout_s);
      } catch (const std::invalid_argument& e) {
        // Python checks the topology at trace time; this guards
        // hand-written calls.
        ops_.erase(key);
        *error = tagged(FailureKind::kInvalid, -1,
                        std::string("jaxring allreduce (") + desc.describe() +
                            "): " + e.what());
        return nullptr;
      }
      if (!slot->flat && !desc.emulated()) {
        // Only link emulation runs other plans here (dispatch.cc).
        ops_.erase(key);
        *error = tagged(FailureKind::kInternal, -1,
                        "jaxring allreduce: a plan other than the flat ring "
                        "reached the in-process ring without link emulation");
        return nullptr;
      }
    }
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
    // A failed op past its grace is gone, whether or not a later join has
    // swept it yet.
    collect_garbage();
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

}  // namespace inprocess

void inprocess_allreduce(const OpKey& key, const OpDesc& desc, int rank,
                         int device, const void* in, void* out,
                         double timeout_s, Completion done) {
  inprocess::Registry& reg = inprocess::Registry::get();
  inprocess::Worker* worker = reg.worker(device);
  std::string error;
  std::shared_ptr<inprocess::Op> op =
      reg.join(key, desc, rank, in, out, worker, timeout_s, &error);
  if (!op) {
    done(error);
    return;
  }
  inprocess::Task task{std::move(op), rank, std::move(done),
                       std::vector<int64_t>(desc.num_rings, 0)};
  worker->submit(std::move(task));
}

int64_t inprocess_pending_ops() { return inprocess::Registry::get().pending(); }

}  // namespace jaxring
