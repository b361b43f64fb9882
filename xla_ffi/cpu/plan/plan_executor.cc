#include "cpu/plan/plan_executor.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <list>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <sstream>
#include <thread>

#include "cpu/deadline.h"
#include "failure.h"
#include "cpu/huge_pages.h"
#include "cpu/task_queue.h"
#include "cpu/timeline.h"
#include "cpu/net/frames.h"
#include "cpu/worker_loop.h"

namespace jaxring {

namespace {

// How long a failed rank waits for its host's abort frames to leave.
constexpr auto kAbortFlush = std::chrono::seconds(1);

// One local rank's part of an operation, held by its device's worker.
struct PlanTask {
  std::shared_ptr<PlanOp> op;
  int rank = 0;
  Completion done;
  // Per ring: the phase this rank runs (num_phases once done), and how many
  // of its non-empty units are still to come.
  std::vector<int> phase;
  std::vector<int64_t> remaining;
  bool started = false;
  // Rings whose phase 0 has begun: all of them at once for a flat plan; in
  // turn for a tiered one (see Pass::start).
  int entered = 0;
  // When to ask for a peer running another program: counted from when this
  // rank last consumed a unit (or joined).
  MismatchProbe probe;
};

const char* phase_name(PhaseKind kind) {
  switch (kind) {
    case PhaseKind::kReduceScatter: return "reduce-scatter";
    case PhaseKind::kAllreduce: return "allreduce";
    case PhaseKind::kAllGather: return "all-gather";
    case PhaseKind::kExchange: return "exchange";
  }
  return "?";
}

}  // namespace

class PlanWorker {
 public:
  explicit PlanWorker(int device) : device_(device) {
    std::thread([this] { loop(); }).detach();
  }
  void submit(PlanTask t) { queue_.submit(std::move(t)); }
  void wake() { queue_.wake(); }

 private:
  void loop();

  const int device_;
  TaskQueue<PlanTask> queue_;
};

namespace {

// One pass of a worker over one task: runs what the rank can run now.
// Holds op.mu, except around copies and reductions of the rank's own
// buffers and while it calls into the host or the completion.
class Pass {
 public:
  Pass(PlanTask& task, int device)
      : task_(task),
        op_(*task.op),
        lock_(op_.mu),
        me_(op_.locals[task.rank]),
        plan_(*op_.plan),
        phases_(plan_.num_phases()),
        esize_(plan_.elem_bytes()),
        device_(device) {}

  // Returns whether anything happened; sets *finished once the task's
  // completion has been called.
  bool run(bool* finished);

 private:
  const char* own(int r, int j, int64_t offset) const {
    return me_.own_contribution(r, j, offset, esize_);
  }
  void start();
  void send(int r, int j, int64_t u, const char* data, int64_t bytes);
  bool enter_next_ring();
  // The parts of run(): completing a failed operation once nothing touches
  // its buffers; consuming the units that arrived, ring by ring; and, with
  // nothing to do, probing for a peer in another program or timing out.
  bool complete_failed(bool* finished);
  bool advance_rings();
  bool advance_ring(int r);
  bool waited(bool progressed, bool all_done);
  void enter_phase(int r, int j);
  void consume(int r, int j, int64_t u);
  bool complete(const std::optional<std::string>& result, bool* finished);
  bool fail_all(const std::string& why);
  std::string timeout_message(bool all_done);
  void unlock_and_wake() {
    lock_.unlock();
    for (PlanWorker* w : wake_) w->wake();
    wake_.clear();
  }
  bool going() const { return error_.empty() && !op_.failed; }

  PlanTask& task_;
  PlanOp& op_;
  std::unique_lock<std::mutex> lock_;
  LocalRank& me_;
  const TieredPlan& plan_;
  const int phases_;
  const int64_t esize_;
  const int device_;
  std::vector<PlanWorker*> wake_;  // ranks of this process to wake
  std::string error_;              // from a send: fails the operation
};

// Unit u of (ring r, phase j), `bytes` at `data`, to this rank's next rank:
// in memory when that rank runs in this process (staged if it has not
// joined or not reached the phase), else through the operation's host. An
// unreachable next rank sets error_.
void Pass::send(int r, int j, int64_t u, const char* data, int64_t bytes) {
  if (op_.failed) return;  // a failed rank's buffers must not be touched
  const int next = plan_.next_rank(r, j, task_.rank);
  const int me = op_.host->process();
  if (op_.process_of_rank[next] != me) {
    // Unlocked: the frame may be copied out on this thread. The rank's
    // buffer stays valid, as the rank runs here and completes after its
    // sends are released.
    lock_.unlock();
    error_ = op_.host->send_remote(task_.op, task_.rank, r, j, u, data, bytes);
    lock_.lock();
    return;
  }
  // The memory link. The ranks of one process share the operation's lock,
  // so the copy runs without it; op_.writers keeps a failed receiver from
  // completing meanwhile, and the unit is announced only once it is there.
  Inbox& ib = op_.inbox(next, r);
  auto local = op_.locals.find(next);
  char* dest;
  if (local != op_.locals.end() && ib.phase == j) {
    dest = static_cast<char*>(local->second.out) +
           plan_.recv_span(r, j, next, u).offset * esize_;
  } else {
    Staged& st = ib.staged[{j, u}];
    st = Staged(static_cast<size_t>(bytes));
    st.from_process = me;
    dest = st.data.get();
  }
  ib.received.insert({j, u});
  ++op_.writers;
  lock_.unlock();
  std::memcpy(dest, data, static_cast<size_t>(bytes));
  lock_.lock();
  --op_.writers;
  if (op_.failed) {  // its ranks may be waiting for this copy to end
    for (PlanWorker* w : op_.workers()) wake_.push_back(w);
    return;
  }
  local = op_.locals.find(next);  // it may have joined meanwhile
  if (local != op_.locals.end()) wake_.push_back(local->second.worker);
  ib.ready[j].push_back(u);
  ++ib.arrived[j];
}

// Starts the rank: room for its own contribution to the later phases, and
// phase 0 of its first ring (of every ring, for a flat plan).
void Pass::start() {
  task_.started = true;
  if (phases_ > 1) {
    // Phase 1's shard holds the shards of all later phases.
    me_.own.resize(plan_.num_rings());
    me_.own_offset.resize(plan_.num_rings());
    for (int r = 0; r < plan_.num_rings(); ++r) {
      const Span s = plan_.shard(r, 1, task_.rank);
      me_.own[r].reset(new char[std::max<int64_t>(1, s.count * esize_)]);
      me_.own_offset[r] = s.offset;
    }
  }
  // A flat plan starts every ring at once. A tiered one starts the first,
  // and each next one once the one before has left the tight tier's phase:
  // where the CPU is short, the first ring then reaches the loose tier's
  // link early, and the rest keep it busy, instead of every ring reaching
  // it only after all of them passed the tight tier. Each ring's phase 0
  // needs only that ring's units, so no rank waits on a ring another has
  // not started for want of one it has not started itself.
  const int first = phases_ > 1 ? 1 : plan_.num_rings();
  while (task_.entered < first && going()) enter_phase(task_.entered++, 0);
}

// A tiered plan's next ring starts once the one before has left phase 0.
bool Pass::enter_next_ring() {
  bool entered = false;
  while (task_.entered > 0 && task_.entered < plan_.num_rings() &&
         task_.phase[task_.entered - 1] > 0 && going()) {
    enter_phase(task_.entered++, 0);
    entered = true;
  }
  return entered;
}

// Moves ring r to phase j: takes a copy of the shard as this rank's own
// contribution (a reduce phase after the first), opens the phase to direct
// writes, and sends the first unit of every chunk.
void Pass::enter_phase(int r, int j) {
  task_.phase[r] = j;
  if (j == phases_) return;
  const Phase& ph = plan_.phase(j);
  Inbox& ib = op_.inbox(task_.rank, r);
  const Span shard = plan_.shard(r, j, task_.rank);
  if (j > 0 && ph.kind != PhaseKind::kAllGather && shard.count > 0) {
    // Units of phase j are staged until ib.phase says otherwise, so the
    // shard can be copied without the lock.
    char* to = me_.own[r].get() + (shard.offset - me_.own_offset[r]) * esize_;
    const char* from =
        static_cast<const char*>(me_.out) + shard.offset * esize_;
    lock_.unlock();
    std::memcpy(to, from, static_cast<size_t>(shard.count * esize_));
    lock_.lock();
    if (op_.failed) return;
  }
  ib.phase = j;
  const int64_t units = plan_.num_units(r, j, task_.rank);
  for (int64_t u = 0; u < units && going(); ++u) {
    if (u % ph.num_steps == 0) {
      const Span s = plan_.send_span(r, j, task_.rank, u);
      if (s.count > 0) {
        const char* data =
            ph.kind == PhaseKind::kAllGather
                ? static_cast<const char*>(me_.out) + s.offset * esize_
                : own(r, j, s.offset);
        send(r, j, u, data, s.count * esize_);
      }
    }
    // Empty units carry nothing: consume them now, nobody sends them.
    if (plan_.recv_span(r, j, task_.rank, u).count > 0) {
      ++task_.remaining[r];
    } else {
      consume(r, j, u);
    }
  }
}

// Unit u of (ring r, phase j) received: reduce it into (or store it as)
// this rank's result, then hand the chunk on to the next rank as unit u+1
// unless it was the phase's last step.
void Pass::consume(int r, int j, int64_t u) {
  const int steps = plan_.phase(j).num_steps;
  const Span span = plan_.recv_span(r, j, task_.rank, u);
  Inbox& ib = op_.inbox(task_.rank, r);
  if (span.count > 0) {
    char* dst = static_cast<char*>(me_.out) + span.offset * esize_;
    auto staged = ib.staged.find({j, u});
    const char* src =
        staged != ib.staged.end() ? staged->second.data.get() : dst;
    const bool reduced = ib.reduced_on_arrival.erase({j, u}) > 0;
    lock_.unlock();
    if (reduced) {
      // Nothing left to do here: the reader did it (see Inbox).
    } else if (plan_.is_reduce_unit(j, u)) {
      // The neighbour's partial first, then this rank's own: the summation
      // order of the ring, whichever link brought the partial (an exchange:
      // the lower-coordinate partner's first, see own_first).
      const char* mine = own(r, j, span.offset);
      if (plan_.own_first(j, task_.rank)) {
        reduce(op_.desc.type, op_.desc.op, dst, mine, src, span.count);
      } else {
        reduce(op_.desc.type, op_.desc.op, dst, src, mine, span.count);
      }
    } else if (src != dst) {
      std::memcpy(dst, src, static_cast<size_t>(span.count * esize_));
    }
    lock_.lock();
    if (staged != ib.staged.end()) ib.staged.erase(staged);
    // The operation may have failed while the lock was dropped; then the
    // other local ranks may have completed, and nothing more is sent.
    if (op_.failed) return;
  }
  if (u % steps != steps - 1) {
    const Span fwd = plan_.send_span(r, j, task_.rank, u + 1);
    if (fwd.count > 0) {
      send(r, j, u + 1, static_cast<const char*>(me_.out) + fwd.offset * esize_,
           fwd.count * esize_);
    }
  }
}

bool Pass::complete(const std::optional<std::string>& result, bool* finished) {
  // Where every rank runs here: across processes dispatch.cc records the
  // span, under the call site's op id rather than this operation's.
  if (!result && timeline_enabled() &&
      static_cast<int>(op_.locals.size()) == op_.desc.world_size) {
    // An allreduce completes only once every rank has sent its part, so all
    // have joined, here.
    int64_t last_join = -1;
    for (const auto& [rank, local] : op_.locals) {
      last_join = std::max(last_join, local.joined_ns);
    }
    timeline_record({device_, op_.key.run_id, op_.key.op_id,
                     op_.desc.count * esize_, op_.desc.num_rings, me_.joined_ns,
                     timeline_now_ns(), last_join});
  }
  const bool last = ++op_.completed_locals == op_.expected_locals;
  unlock_and_wake();
  if (last) op_.host->forget(task_.op);
  task_.done(result);
  *finished = true;
  return true;
}

// Fails the operation for every rank; this task completes on a later pass,
// once nothing touches its buffers.
bool Pass::fail_all(const std::string& why) {
  unlock_and_wake();
  op_.host->fail(task_.op, why);
  return true;
}

std::string Pass::timeout_message(bool all_done) {
  std::ostringstream os;
  os << op_.name() << " timed out after " << op_.timeout_s << " s on rank "
     << task_.rank << ": ";
  const char* sep = "";
  for (int r = 0; r < plan_.num_rings(); ++r) {
    const int j = task_.phase[r];
    // A ring not yet started waits for the one before it, named already.
    if (j >= phases_ || r >= task_.entered) continue;
    const Phase& ph = plan_.phase(j);
    const int prev = plan_.prev_rank(r, j, task_.rank);
    Inbox& ib = op_.inbox(task_.rank, r);
    os << sep << "ring " << r;
    if (phases_ > 1) {
      os << " (" << phase_name(ph.kind) << " along tier " << ph.tier << ")";
    }
    os << " waits for rank " << prev << " (process "
       << op_.process_of_rank[prev] << "): " << ib.arrived[j] << " of "
       << ib.arrived[j] + task_.remaining[r] << " chunks arrived";
    sep = "; ";
  }
  if (all_done) {
    os << me_.outstanding_sends << " frame(s) to the next rank not yet sent";
  }
  os << ". Every process must run the same allreduces; a peer that stopped "
        "responding or took a different branch never sends.";
  return os.str();
}

bool Pass::run(bool* finished) {
  if (op_.failed) return complete_failed(finished);
  bool progressed = false;
  if (!task_.started) {
    start();
    progressed = true;
  }
  progressed |= advance_rings();
  if (phases_ > 1) progressed |= enter_next_ring();
  bool all_done = true;
  for (int r = 0; r < plan_.num_rings(); ++r)
    all_done &= task_.phase[r] == phases_;
  if (!error_.empty()) return fail_all(error_);
  if (op_.failed) return true;  // completes through the failure, next pass
  if (all_done && me_.outstanding_sends == 0)
    return complete(std::nullopt, finished);
  return waited(progressed, all_done);
}

bool Pass::complete_failed(bool* finished) {
  // Complete once no I/O thread still touches this rank's buffers.
  if (op_.writers > 0 || me_.outstanding_sends > 0) return false;
  if (op_.aborts_in_flight.load() > 0 &&
      Clock::now() < op_.failed_at + kAbortFlush) {
    return false;
  }
  return complete(op_.error, finished);
}

bool Pass::advance_rings() {
  bool progressed = false;
  for (int r = 0; r < task_.entered && going(); ++r) {
    const bool ring_progressed = advance_ring(r);
    progressed |= ring_progressed;
    // A tiered plan's rings take turns by priority, the first ring first
    // (the reason is Pass::start's): a rank that has work on a ring leaves
    // the later rings for the next pass.
    if (phases_ > 1 && ring_progressed) break;
  }
  return progressed;
}

bool Pass::advance_ring(int r) {
  Inbox& ib = op_.inbox(task_.rank, r);
  bool progressed = false;
  while (task_.phase[r] < phases_ && going()) {
    const int j = task_.phase[r];
    std::deque<int64_t>& ready = ib.ready[j];
    while (!ready.empty() && going()) {
      const int64_t u = ready.front();
      ready.pop_front();
      consume(r, j, u);
      --task_.remaining[r];
      progressed = true;
    }
    if (task_.remaining[r] > 0) break;
    // An exchange phase sent its whole shard from the rank's copy, which
    // the next phase overwrites: frames to other processes that still read
    // it must be out first (their release wakes this worker). A nested
    // plan's next phase copies only the segment the rank kept, which its
    // sends never read.
    if (j + 1 < phases_ && plan_.shape() == PlanShape::kExchange &&
        me_.outstanding_sends > 0) {
      break;
    }
    enter_phase(r, j + 1);
    progressed = true;
  }
  return progressed;
}

bool Pass::waited(bool progressed, bool all_done) {
  const WaitVerdict verdict =
      watch_wait(progressed, Clock::now(), op_.deadline, &task_.probe);
  if (verdict == WaitVerdict::kLookForOtherProgram) {
    // Waiting with nothing to do: is a peer at this call site in another
    // program? (The host fails this operation if so; the next pass
    // completes.)
    unlock_and_wake();
    op_.host->check_programs_agree(task_.op);
    return false;
  }
  if (verdict == WaitVerdict::kTimedOut) {
    // Which peer is stuck is known only when every ring waits for the same.
    std::set<int> waited_for;
    for (int r = 0; r < plan_.num_rings(); ++r) {
      if (task_.phase[r] >= phases_ || r >= task_.entered) continue;
      waited_for.insert(
          op_.process_of_rank[plan_.prev_rank(r, task_.phase[r], task_.rank)]);
    }
    // A rank of this process is no peer to blame (all of them run here).
    const int peer =
        waited_for.size() == 1 && *waited_for.begin() != op_.host->process()
            ? *waited_for.begin()
            : -1;
    return fail_all(
        tagged(FailureKind::kTimeout, peer, timeout_message(all_done)));
  }
  unlock_and_wake();
  return progressed;
}

}  // namespace

void PlanWorker::loop() {
  run_worker_loop<PlanTask>(
      [this](std::list<PlanTask>& active) { return queue_.collect(active); },
      [this](PlanTask& task, bool* finished) {
        return Pass(task, device_).run(finished);
      },
      [this](uint64_t seen, const std::list<PlanTask>& active) {
        // The deadline poll bounds the sleep so timeouts are noticed; an
        // empty list waits in the next collect() instead.
        if (!active.empty()) {
          queue_.wait_until(seen, Clock::now() + kDeadlinePoll);
        }
      });
}

PlanWorker* plan_worker(int device) {
  // Leaked on purpose, with the workers: see PlanWorker.
  static std::mutex* mu = new std::mutex();
  static auto* workers = new std::map<int, std::unique_ptr<PlanWorker>>();
  std::lock_guard<std::mutex> lock(*mu);
  auto& w = (*workers)[device];
  if (!w) w.reset(new PlanWorker(device));
  return w.get();
}

void wake(PlanWorker* worker) { worker->wake(); }

std::string join_rank(PlanOp& op, const OpDesc& desc, int rank, int device,
                      int me, const std::vector<int>& process_of_rank,
                      const void* in, void* out, double timeout_s,
                      bool* fails_all) {
  *fails_all = false;
  if (op.process_of_rank.empty()) {
    // The first local rank: now the peers to tell about a failure are known.
    op.process_of_rank = process_of_rank;
    op.expected_locals = static_cast<int>(
        std::count(process_of_rank.begin(), process_of_rank.end(), me));
    op.timeout_s = timeout_s;
    op.deadline = after_seconds(timeout_s);
  }
  if (op.failed) return op.error;
  std::string error;
  if (op.has_desc && !same_operation(op.desc, desc)) {
    std::ostringstream os;
    os << op_name(op.key, desc) << ": rank " << rank << " (process " << me
       << ") called it with " << desc.describe() << " but other rank(s) with "
       << op.desc.describe()
       << ". Every rank must pass the same shape, dtype and op.";
    error = tagged(FailureKind::kMismatch, -1, os.str());
  } else if (op.process_of_rank != process_of_rank) {
    error =
        tagged(FailureKind::kMismatch, -1,
               op_name(op.key, desc) +
                   ": ranks of this process disagree on where the ranks run");
  } else if (std::string forged = op.misrouted_staged_frame();
             !forged.empty()) {
    error = tagged(FailureKind::kMismatch, -1, forged);
  } else if (op.locals.count(rank)) {
    std::ostringstream os;
    os << op_name(op.key, desc) << ": rank " << rank
       << " joined twice (two devices computed the same rank)";
    error = tagged(FailureKind::kInternal, -1, os.str());
  } else if (!op.has_desc) {
    try {
      op.set_desc(desc);
    } catch (const std::exception& e) {
      error = tagged(FailureKind::kInvalid, -1,
                     op_name(op.key, desc) + ": " + e.what());
    }
  }
  if (!error.empty()) {
    *fails_all = true;  // the other ranks would wait for this one
    return error;
  }
  advise_huge_pages(out, desc.count * elem_bytes(desc.type));
  LocalRank& l = op.locals[rank];
  const int64_t bytes = desc.count * elem_bytes(desc.type);
  if (in == out && bytes > 0) {
    l.input_copy.reset(new char[bytes]);
    std::memcpy(l.input_copy.get(), in, static_cast<size_t>(bytes));
    in = l.input_copy.get();
  }
  l.in = in;
  l.out = out;
  l.device = device;
  l.worker = plan_worker(device);
  l.joined_ns = timeline_now_ns();
  // Units that arrived before this rank joined stay staged; its worker
  // consumes them from there.
  for (int r = 0; r < desc.num_rings; ++r) op.inbox(rank, r);
  return std::string();
}

void run_rank(std::shared_ptr<PlanOp> op, int rank, Completion done) {
  PlanWorker* worker;
  int rings;
  {
    std::lock_guard<std::mutex> lock(op->mu);
    worker = op->locals.at(rank).worker;
    rings = op->desc.num_rings;
  }
  PlanTask task;
  task.op = std::move(op);
  task.rank = rank;
  task.done = std::move(done);
  task.phase.assign(rings, 0);
  task.remaining.assign(rings, 0);
  worker->submit(std::move(task));
}

}  // namespace jaxring
