// The in-process transport's state, shared by its parts: the operation all
// ranks of one allreduce meet in (Op), each rank's slot in it, the task a
// device's worker holds for it, and the worker thread. The ring runs in
// inprocess_transport.cc, link emulation in inprocess_emulation.cc, the
// direct algorithm in inprocess_direct.cc. Private to those files.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <list>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "tiered_plan.h"
#include "cpu/op_plan.h"
#include "cpu/operation.h"
#include "cpu/task_queue.h"

namespace jaxring::inprocess {

using Clock = std::chrono::steady_clock;

inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             Clock::now().time_since_epoch())
      .count();
}

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
        plan(plan_for(d)),
        flat(is_flat_ring(plan)),
        slots(d.world_size),
        deadline(Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                    std::chrono::duration<double>(timeout_s))),
        timeout_s(timeout_s) {
    if (flat) {
      int64_t units = 0;
      for (int r = 0; r < d.num_rings; ++r) {
        unit_base.push_back(units);
        units += chunks(r) * steps();
      }
      num_units = units;
      for (int r = 0; r < d.num_rings; ++r) num_pipelines += chunks(r);
    } else {
      // Another plan's data moves ring by ring (run_emulated).
      num_pipelines = d.num_rings;
    }
    // A share is worth handing to another thread only if it is a few
    // milliseconds of copying: a worker woken for less may wait longer for
    // a core than the work takes.
    const int64_t bytes = d.count * elem_bytes(d.type);
    const int64_t per_pipeline = bytes / std::max<int64_t>(num_pipelines, 1);
    pipelines_per_share =
        std::max<int64_t>(1, (kMinShareBytes + per_pipeline - 1) /
                                 std::max<int64_t>(per_pipeline, 1));
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
  // The plan desc names (op_plan.h). Without link emulation it is always
  // the flat ring (dispatch.cc sends other plans to the plan
  // executor): the tiered plan of one tier, whose one phase (none in a
  // world of one) is the whole 2(p-1)-step allreduce. Its units are the
  // CPU executor's and the CUDA stream schedule's. Under emulation any
  // plan runs here (run_emulated); the members below that speak of units,
  // steps and pipelines of chunks describe the flat ring only.
  const TieredPlan plan;
  const bool flat;
  int steps() const { return plan.num_phases() ? plan.phase(0).num_steps : 0; }
  // Chunk slots per segment of ring r, the same at every rank.
  int64_t chunks(int r) const {
    return plan.num_phases() ? plan.num_chunks(r, 0, 0) : 0;
  }
  int prev_rank(int r, int rank) const { return plan.prev_rank(r, 0, rank); }
  int next_rank(int r, int rank) const { return plan.next_rank(r, 0, rank); }
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
  int64_t num_pipelines = 0;  // chunks of all rings (flat); else rings
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
  std::string ranks_without(std::atomic<bool> RankSlot::* flag) const {
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

 private:
  void loop();
  // After a pass that moved nothing: sleeps until a peer or a new task
  // wakes the worker, the emulated link delivers, or the deadline poll.
  void idle(uint64_t seen, const std::list<Task>& active);

  // Runs what the task can run now. Returns whether anything happened; sets
  // *finished once the task's completion has been called.
  bool advance(Task& task, bool* finished);
  // The direct algorithm's whole part for one rank, once every rank is here.
  bool run_direct(Task& task);
  // Link emulation: once every rank is here, the workers move the data in
  // pipelines (move_share), one of them computes the modelled link's
  // times (emulated_finish_times), and each rank then waits for its time.
  bool run_emulated(Task& task);

  std::vector<char> scratch_;  // the direct algorithm's accumulator

  const int device_;
  TaskQueue<Task> queue_;
};

// Moves the data of unit `cur` of ring r at `rank`: reduces (or copies) the
// chunk the plan says it receives from its neighbour into its output. The
// caller guarantees the neighbour has done the unit before it.
void run_unit(Op& op, int r, int rank, int64_t cur);

}  // namespace jaxring::inprocess
