// The state of one allreduce that runs the tiered plan (tiered_plan.h) on
// the plan executor (plan_executor.h): its description and plan, the ranks
// of it that run in this process, and the units that arrived for them.
//
// The transport that holds an operation (TCP across processes, or the
// in-process host for tiered plans within one process) implements OpHost:
// it carries units to ranks of other processes, and keeps the book of its
// operations and their failures. Units between ranks of this process move
// in memory, through the executor's own path.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "tiered_plan.h"
#include "cpu/deadline.h"
#include "cpu/operation.h"
#include "cpu/plan/staging_pool.h"

namespace jaxring {

class PlanWorker;
struct PlanOp;

// How long an operation created by frames waits for a local rank to start
// it before it is dropped, until a local call says otherwise (jaxring's
// default timeout_s).
constexpr double kDefaultTimeoutS = 300.0;

class OpHost {
 public:
  virtual ~OpHost() = default;
  // This process's index in an operation's process_of_rank.
  virtual int process() const = 0;
  // Queues unit u of (ring, phase), `bytes` at `data` (which stays valid
  // until the send is released), from `rank` to its next rank, which runs in
  // another process. Requires op.mu not held: the frame may be written on
  // the calling thread. Returns a tagged error if it cannot be sent, else "".
  virtual std::string send_remote(const std::shared_ptr<PlanOp>& op, int rank,
                                  int ring, int phase, int64_t u,
                                  const char* data, int64_t bytes) = 0;
  // Fails op for every rank, telling the other processes that run ranks of
  // it. Requires op.mu not held.
  virtual void fail(const std::shared_ptr<PlanOp>& op,
                    const std::string& why) = 0;
  // Every local rank of op has completed: the host drops it.
  virtual void forget(const std::shared_ptr<PlanOp>& op) = 0;
  // A local rank has waited a while without progress: the host may check
  // whether another process runs a different program (and fail op if so).
  // Requires op.mu not held.
  virtual void check_programs_agree(const std::shared_ptr<PlanOp>& op) = 0;
};

// Units of one (local rank, ring) received from the previous ranks.
struct Inbox {
  bool created = false;
  // The phase whose units may be written straight into the rank's result.
  // A unit of a later phase is staged: its element range may still be in
  // use by this one (see tiered_plan.h).
  int phase = 0;
  // Per phase: units whose data is here and not yet reduced/stored, in
  // arrival order. Units of a phase are independent on the receiving side
  // (each writes its own chunk of the result), so they are consumed as
  // they come: a chunk of step t+1 never waits behind one of step t still
  // on the wire.
  std::map<int, std::deque<int64_t>> ready;
  std::map<int, int64_t> arrived;  // per phase (for timeout messages)
  // (phase, unit)s that came before the rank joined or reached their phase.
  std::map<std::pair<int, int64_t>, Staged> staged;
  // Every (phase, unit) accepted so far, staged or written straight into the
  // result: the plan sends each once, so a second copy is refused rather
  // than counted again (a rank would then finish with a unit missing).
  std::set<std::pair<int, int64_t>> received;
  // Reduce units whose reader already reduced them into the result as they
  // arrived (straight out of a shared-memory ring): consuming them only
  // hands them on.
  std::set<std::pair<int, int64_t>> reduced_on_arrival;
};

// A rank of the operation that runs in this process.
struct LocalRank {
  const void* in = nullptr;
  void* out = nullptr;
  PlanWorker* worker = nullptr;
  int device = 0;
  int64_t joined_ns = 0;
  int outstanding_sends = 0;  // frames queued that still read our buffers
  // Per ring, with a tiered plan: the rank's own contribution to the phase
  // it runs (a copy of the previous phase's result), covering the shard of
  // phase 1, which holds every later one, from own_offset on.
  std::vector<std::unique_ptr<char[]>> own;
  std::vector<int64_t> own_offset;
  // A copy of the input when it is the output buffer too: units are
  // received into the output while the input is still to be reduced.
  std::unique_ptr<char[]> input_copy;

  // This rank's own contribution to the reduce steps of phase j of ring r,
  // for the element at `offset`: its input in the first phase, the copy of
  // the previous phase's result after that (valid once the phase began).
  const char* own_contribution(int r, int j, int64_t offset,
                               int64_t esize) const {
    if (j == 0) return static_cast<const char*>(in) + offset * esize;
    return own[r].get() + (offset - own_offset[r]) * esize;
  }
};

struct PlanOp {
  PlanOp(const OpKey& k, OpHost* h) : key(k), host(h) {}

  const OpKey key;
  OpHost* const host;
  std::mutex mu;  // guards everything below
  bool has_desc = false;
  OpDesc desc;
  std::unique_ptr<TieredPlan> plan;
  std::vector<int> process_of_rank;  // set by the first local rank to join
  int expected_locals = 0;
  int completed_locals = 0;
  std::map<int, LocalRank> locals;
  std::map<std::pair<int, int>, Inbox> inboxes;  // (rank, ring)
  // Until a local rank joins: when an operation created by frames expires.
  Clock::time_point deadline = after_seconds(kDefaultTimeoutS);
  double timeout_s = kDefaultTimeoutS;
  bool failed = false;
  std::atomic<bool> failed_flag{false};  // readable without mu by the I/O
  std::string error;
  Clock::time_point failed_at;
  // Threads copying into a local rank's buffer without mu (a TCP reader, a
  // rank sending in memory): a failed rank completes only once none is.
  int writers = 0;
  int first_sender = -1;     // process whose frame created it, if one did
  std::set<int> heard_from;  // processes whose data frames it accepted
  // Abort frames this process queued for the operation and not yet written;
  // a failed rank completes once they are out (or kAbortFlush passed), so
  // peers learn the cause even if this process exits right after.
  std::atomic<int> aborts_in_flight{0};

  // Requires mu. Throws std::invalid_argument on a description no plan
  // fits (a topology whose product is not the world size).
  void set_desc(const OpDesc& d);
  // Requires mu. Marks the operation failed with `why`, unless it already
  // was (then false); the caller wakes workers().
  bool mark_failed(const std::string& why);
  // Requires mu. The workers of the local ranks.
  std::vector<PlanWorker*> workers() const;
  // Requires mu.
  Inbox& inbox(int rank, int ring) {
    Inbox& ib = inboxes[{rank, ring}];
    ib.created = true;
    return ib;
  }
  // Requires mu, a plan and process_of_rank. Whether the plan has process p
  // send data to a rank of this process: only such a process can prove, by
  // sending nothing here and something elsewhere, that it runs another
  // program (a process upstream of none of ours may legitimately finish
  // and move on without a word to us; so may one whose every unit to us is
  // empty, for a buffer smaller than its ring's segments).
  bool expects_data_from(int p) const;
  // A frame staged before any local rank joined that came from a process
  // other than the one running its sender rank ("" if none). Requires mu
  // and process_of_rank.
  std::string misrouted_staged_frame() const;
  std::string name() const;
};

}  // namespace jaxring
