#include "cpu/direct/host_direct.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <deque>
#include <list>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>

#include "failure.h"
#include "reduce.h"
#include "cpu/deadline.h"
#include "cpu/direct/host_segment.h"
#include "cpu/huge_pages.h"
#include "cpu/worker_loop.h"

namespace jaxring {

namespace {

// mark_failed's generation for an entry the caller holds (it cannot change).
constexpr uint64_t kAnyGeneration = ~uint64_t{0};
// How long a failing rank waits at most while another mark holds the
// entry's failure word (DirectWorker::fail).
constexpr auto kSettleFor = std::chrono::milliseconds(200);

// How long an idle or waiting worker sleeps at most.
constexpr int64_t kPollNs = std::chrono::nanoseconds(kDeadlinePoll).count();

enum class Stage { kClaim, kCopyIn, kWaitInputs, kWaitResult };

struct DirectTask {
  OpKey key;
  OpDesc desc;
  int rank = 0;
  std::vector<int> processes;  // the operation's, each once, this one included
  std::vector<int> ranks_of;   // how many of its ranks each of processes runs
  const char* in = nullptr;
  char* out = nullptr;
  Clock::time_point deadline;
  double timeout_s = 0;
  Completion done;
  Stage stage = Stage::kClaim;
  int entry = -1;
  int64_t round = 0;
  int64_t rounds = 0;
  int64_t target = 0;   // arrivals that pass the barrier waited for
  MismatchProbe probe;  // counted from the task's last progress
};

int entry_of(const OpKey& key) {
  const uint64_t h = static_cast<uint64_t>(key.op_id) * 0x9E3779B97F4A7C15ull ^
                     static_cast<uint64_t>(key.group) * 0xC2B2AE3D27D4EB4Full;
  return static_cast<int>((h >> 32) % kHostEntries);
}

// An entry's fields, copied out at one state word (DirectWorker::snapshot).
struct EntryFields {
  int64_t run_id = 0, op_id = 0, group = 0, count = 0, slot_id = 0;
  int32_t elem_type = 0, reduce_op = 0, world = 0;
  uint32_t shape_digest = 0;
};

// Whether the ranks of an operation agree on what it is.
bool fields_agree(const EntryFields& f, const OpDesc& d) {
  return f.elem_type == static_cast<int32_t>(d.type) &&
         f.reduce_op == static_cast<int32_t>(d.op) && f.count == d.count &&
         f.world == d.world_size &&
         shapes_agree(f.shape_digest, d.shape_digest);
}

// A direct allreduce as OpDesc::describe names an operation, without the
// ring plan's rings and chunks. The type and op may come from a peer, so
// they are checked before they are named.
std::string describe_direct(int32_t elem_type, int32_t reduce_op, int64_t count,
                            int32_t world) {
  ReduceOp op;
  if (elem_type < 0 || elem_type > static_cast<int>(ElemType::kU64) ||
      !reduce_op_from_int(reduce_op, &op)) {
    return "an operation this build does not know";
  }
  return std::to_string(count) + " x " +
         elem_type_name(static_cast<ElemType>(elem_type)) +
         ", op=" + reduce_op_name(op) + ", world=" + std::to_string(world) +
         ", algorithm=direct";
}

std::string fields_desc(const EntryFields& f) {
  return describe_direct(f.elem_type, f.reduce_op, f.count, f.world);
}

std::string desc_of(const OpDesc& d) {
  return describe_direct(static_cast<int32_t>(d.type),
                         static_cast<int32_t>(d.op), d.count, d.world_size) +
         (d.shapes.empty() ? "" : ", shapes " + d.shapes);
}

int lowest_process(uint64_t mask) {
  for (int q = 0; q < 64; ++q) {
    if (mask & (uint64_t{1} << q)) return q;
  }
  return -1;
}

class DirectWorker {
 public:
  DirectWorker(HostSegment* seg, int me) : seg_(seg), me_(me) {
    std::thread([this] { loop(); }).detach();
  }

  void submit(DirectTask t) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      incoming_.push_back(std::move(t));
      ++pending_;
    }
    seg_->ring(me_);
  }

  int64_t pending() {
    std::lock_guard<std::mutex> lock(mu_);
    return pending_;
  }

 private:
  void loop() {
    run_worker_loop<DirectTask>(
        [this](std::list<DirectTask>& active) {
          // The doorbell before the tasks: a ring after this read wakes the
          // idle wait below.
          const uint32_t seen =
              seg_->doorbell(me_).load(std::memory_order_acquire);
          std::lock_guard<std::mutex> lock(mu_);
          while (!incoming_.empty()) {
            active.push_back(std::move(incoming_.front()));
            incoming_.pop_front();
          }
          return seen;
        },
        [this](DirectTask& task, bool* finished) {
          if (!advance(task, finished)) return false;
          task.probe.progressed(Clock::now());
          return true;
        },
        [this](uint32_t seen, const std::list<DirectTask>&) {
          seg_->wait(me_, seen, kPollNs);
        });
  }

  void ring_processes(const std::vector<int>& processes) {
    for (int q : processes) seg_->ring(q);
  }
  void ring_host() {
    for (int q = 0; q < seg_->processes(); ++q) seg_->ring(q);
  }

  // The bytes of round r's chunk (every chunk but the last is full).
  int64_t chunk_bytes(const DirectTask& t, int64_t r) const {
    const int64_t total = t.desc.count * elem_bytes(t.desc.type);
    return std::min(seg_->chunk_bytes(), total - r * seg_->chunk_bytes());
  }

  // One more arrival at the barrier t.target names; the last rings everyone.
  void arrive(DirectTask& t) {
    HostEntry& e = seg_->entry(t.entry);
    e.process_arrivals[me_].fetch_add(1, std::memory_order_relaxed);
    if (e.arrivals.fetch_add(1, std::memory_order_acq_rel) + 1 == t.target) {
      ring_processes(t.processes);
    }
  }

  // The rank leaves the entry. The last rank to leave frees it: once the
  // whole world joined and left, or once the operation failed and every
  // rank that joined left (a rank that never came must not keep the entry
  // from the operations after it).
  void depart(DirectTask& t) {
    namespace es = entry_state;
    HostEntry& e = seg_->entry(t.entry);
    const int world = e.world.load(std::memory_order_relaxed);
    e.departed_processes.fetch_or(uint64_t{1} << me_,
                                  std::memory_order_relaxed);
    uint64_t s = e.state.load(std::memory_order_acquire);
    for (;;) {
      const int left = es::departed(s) + 1;
      const bool last =
          left == es::joined(s) &&
          (left >= world || e.failed_by.load(std::memory_order_acquire) != 0);
      const uint64_t next =
          last ? es::make(es::generation(s), es::kFree, 0, 0)
               : es::make(es::generation(s), es::kind(s), es::joined(s), left);
      if (e.state.compare_exchange_weak(s, next, std::memory_order_acq_rel)) {
        if (last) ring_host();
        break;
      }
    }
    t.entry = -1;
  }

  bool finish(DirectTask& t, const std::optional<std::string>& error,
              bool* finished) {
    if (t.entry >= 0) depart(t);
    {
      std::lock_guard<std::mutex> lock(mu_);
      --pending_;
    }
    Completion done = std::move(t.done);
    done(error);
    *finished = true;
    return true;
  }

  // How a rank's errors begin (what the entry records names only the rank:
  // each rank that reports the failure names itself).
  static std::string label(const DirectTask& t) {
    return "jaxring allreduce (direct across processes, op " +
           std::to_string(t.key.op_id) + ", group " +
           std::to_string(t.key.group) + ", rank " + std::to_string(t.rank) +
           ")";
  }

  // Fails the operation for this rank and, once it holds the entry, for
  // every rank: the first failure recorded is the one every rank reports
  // (this one's, if the one being recorded cannot be read yet).
  bool fail(DirectTask& t, FailureKind kind, int peer, const std::string& why,
            bool* finished) {
    if (t.entry >= 0) {
      HostEntry& e = seg_->entry(t.entry);
      const std::string message =
          tagged(kind, peer, "rank " + std::to_string(t.rank) + ": " + why);
      // While another mark holds the entry (-1) it is writing its failure,
      // or taking back one meant for the entry's previous operation, which
      // takes microseconds: wait for it, so that whichever it was, a
      // failure is published for every rank. A marker that never settles
      // (its process died while writing) leaves this rank its own error.
      const auto settle_by = Clock::now() + kSettleFor;
      while (Clock::now() < settle_by) {
        if (mark_failed(e, message)) break;
        if (e.failed_by.load(std::memory_order_acquire) > 0) {
          return failed_elsewhere(t, finished);
        }
        std::this_thread::yield();
      }
    }
    return finish(t, tagged(kind, peer, label(t) + ": " + why), finished);
  }

  // A peer failed the operation: its error, retagged by this process from
  // what it may say (its text is only text).
  bool failed_elsewhere(DirectTask& t, bool* finished) {
    HostEntry& e = seg_->entry(t.entry);
    const int32_t by = e.failed_by.load(std::memory_order_acquire);
    char text[sizeof(e.error)];
    std::memcpy(text, e.error, sizeof(text));
    text[sizeof(text) - 1] = '\0';
    FailureKind kind;
    int peer;
    std::string rest;
    if (!parse_tag(text, &kind, &peer, &rest)) kind = FailureKind::kInternal;
    if (by < 1 || by > seg_->processes()) {
      return finish(t,
                    tagged(FailureKind::kInternal, -1,
                           label(t) + ": a peer marked it failed in a way this "
                                      "process cannot read"),
                    finished);
    }
    if (peer < -1 || peer >= seg_->processes()) peer = -1;
    if (kind == FailureKind::kTimeout || kind == FailureKind::kPeerLost ||
        kind == FailureKind::kMismatch) {
      // Keep the peer it names: that is the process to look at.
    } else {
      peer = by - 1;
    }
    return finish(t,
                  tagged(kind, peer,
                         label(t) + ": process " + std::to_string(by - 1) +
                             " failed it: " + rest),
                  finished);
  }

  // The processes a timed-out wait was waiting for, as the end of its
  // message, and the first of them (*peer; -1 if none is known): those
  // that never joined the operation's entry, else those whose ranks have
  // not all arrived at the barrier this rank waits at, or, before this
  // rank holds the entry, those that hold it and have not left. The
  // counters are read while others may move them: a process named has
  // not moved for the whole timeout, so it is named right.
  std::string waited_for(const DirectTask& t, int* peer) {
    *peer = -1;
    std::vector<int> late;
    std::string how;
    if (t.entry < 0) {
      const HostEntry& e = seg_->entry(entry_of(t.key));
      const uint64_t holding =
          e.joined_processes.load(std::memory_order_acquire) &
          ~e.departed_processes.load(std::memory_order_acquire);
      for (int q = 0; q < seg_->processes(); ++q) {
        if (q != me_ && (holding & (uint64_t{1} << q))) late.push_back(q);
      }
      how = "which has not left the allreduce holding that entry";
    } else {
      const HostEntry& e = seg_->entry(t.entry);
      const uint64_t joined =
          e.joined_processes.load(std::memory_order_acquire);
      for (int q : t.processes) {
        if (!(joined & (uint64_t{1} << q))) late.push_back(q);
      }
      how = "which never reached this allreduce";
      if (late.empty() && t.target > 0) {
        const int64_t barriers = t.target / t.desc.world_size;
        for (size_t i = 0; i < t.processes.size(); ++i) {
          const int q = t.processes[i];
          if (e.process_arrivals[q].load(std::memory_order_acquire) <
              t.ranks_of[i] * barriers) {
            late.push_back(q);
          }
        }
        how =
            "which reached this allreduce but not the step this rank waits at "
            "(stopped, or busy elsewhere?)";
      }
    }
    if (late.empty()) return "";
    *peer = late.front();
    std::string names;
    for (int q : late) {
      names += (names.empty() ? "" : ", ") + std::to_string(q) + " (pid " +
               std::to_string(seg_->pid_of(q)) + ")";
    }
    return "; waited for process " + names + ", " + how;
  }

  // Whether a wait has run out: the deadline, a peer process gone, or a
  // peer in another program.
  bool waited_too_long(DirectTask& t, const std::string& what, bool* finished) {
    for (int q : t.processes) {
      if (q != me_ && seg_->exited(q)) {
        return fail(
            t, FailureKind::kPeerLost, q,
            "process " + std::to_string(q) + " (pid " +
                std::to_string(seg_->pid_of(q)) +
                ") exited during a direct allreduce over the host segment",
            finished);
      }
    }
    const WaitVerdict verdict =
        watch_wait(false, Clock::now(), t.deadline, &t.probe);
    if (verdict == WaitVerdict::kLookForOtherProgram) {
      std::string why;
      const int other = in_another_program(t, &why);
      if (other >= 0)
        return fail(t, FailureKind::kMismatch, other, why, finished);
    }
    if (verdict == WaitVerdict::kTimedOut) {
      int peer;
      std::ostringstream os;
      os << "timed out after " << t.timeout_s << " s: " << what
         << waited_for(t, &peer);
      return fail(t, FailureKind::kTimeout, peer, os.str(), finished);
    }
    return false;
  }

  // The fields of entry f as they were at one state word (false: it is
  // being claimed, or changed while read).
  bool snapshot(HostEntry& e, EntryFields* out, uint64_t* state) {
    const uint64_t s = e.state.load(std::memory_order_acquire);
    if (entry_state::kind(s) != entry_state::kActive) return false;
    out->run_id = e.run_id.load(std::memory_order_relaxed);
    out->op_id = e.op_id.load(std::memory_order_relaxed);
    out->group = e.group.load(std::memory_order_relaxed);
    out->count = e.count.load(std::memory_order_relaxed);
    out->slot_id = e.slot_id.load(std::memory_order_relaxed);
    out->elem_type = e.elem_type.load(std::memory_order_relaxed);
    out->reduce_op = e.reduce_op.load(std::memory_order_relaxed);
    out->world = e.world.load(std::memory_order_relaxed);
    out->shape_digest = e.shape_digest.load(std::memory_order_relaxed);
    std::atomic_thread_fence(std::memory_order_acquire);
    *state = e.state.load(std::memory_order_relaxed);
    return entry_state::generation(*state) == entry_state::generation(s) &&
           entry_state::kind(*state) == entry_state::kActive;
  }

  // A peer at this call site in another program: an entry of the same
  // slot and group, held for another operation with another description,
  // whose first barrier waits (as this one's does), whose processes are
  // this operation's but none that joined this one. A peer merely ahead,
  // in the next program, holds such an entry only once this operation
  // passed its first barrier; another group of this call site is another
  // group. Marks that entry failed too, so its ranks learn why, and
  // returns the process named (-1: none found).
  int in_another_program(DirectTask& t, std::string* why) {
    if (t.desc.slot_id == 0) return -1;
    uint64_t mine = uint64_t{1} << me_;
    if (t.entry >= 0) {
      const HostEntry& e = seg_->entry(t.entry);
      if (e.arrivals.load(std::memory_order_acquire) >= t.desc.world_size)
        return -1;
      mine = e.joined_processes.load(std::memory_order_acquire);
    }
    uint64_t ours = 0;
    for (int q : t.processes) ours |= uint64_t{1} << q;
    for (int f = 0; f < kHostEntries; ++f) {
      if (f == t.entry) continue;
      HostEntry& other = seg_->entry(f);
      EntryFields o;
      uint64_t state;
      if (!snapshot(other, &o, &state)) continue;
      const uint64_t theirs =
          other.joined_processes.load(std::memory_order_acquire);
      if (o.slot_id != t.desc.slot_id || o.group != t.key.group ||
          (o.run_id == t.key.run_id && o.op_id == t.key.op_id) ||
          fields_agree(o, t.desc) || theirs == 0 || (theirs & ~ours) != 0 ||
          (theirs & mine) != 0 ||
          other.arrivals.load(std::memory_order_acquire) >= o.world ||
          other.failed_by.load(std::memory_order_acquire) != 0) {
        continue;
      }
      const int q = lowest_process(theirs);
      // Named by number, not "this process": the text reaches every process.
      *why = "the processes run different programs: process " +
             std::to_string(me_) + " calls it with " + desc_of(t.desc) +
             " but process " + std::to_string(q) + " with " + fields_desc(o) +
             shape_difference(t.desc.shape_digest, o.shape_digest) +
             ". Every process must run the same program with the same shapes, "
             "dtypes and ops.";
      mark_failed(other, tagged(FailureKind::kMismatch, me_, *why),
                  entry_state::generation(state));
      return q;
    }
    return -1;
  }

  // Records `message` as the entry's failure unless one is there already;
  // the ranks in it learn it at their next look. With `generation`, only
  // while the entry is still that claim's: an entry of another operation
  // (in_another_program) may be freed and claimed by an unrelated one at
  // any moment, which must not fail. A claim resets failed_by after it
  // changed the generation, so a mark that began on the old claim either
  // sees the new generation and takes itself back, or finds failed_by
  // reset when it would publish, and publishes nothing.
  bool mark_failed(HostEntry& e, const std::string& message,
                   uint64_t generation = kAnyGeneration) {
    int32_t none = 0;
    if (!e.failed_by.compare_exchange_strong(none, -1)) return false;
    if (generation != kAnyGeneration &&
        entry_state::generation(e.state.load()) != generation) {
      int32_t writing = -1;
      e.failed_by.compare_exchange_strong(writing, 0);
      return false;
    }
    const size_t n = std::min(message.size(), sizeof(e.error) - 1);
    std::memcpy(e.error, message.data(), n);
    e.error[n] = '\0';
    int32_t writing = -1;
    if (!e.failed_by.compare_exchange_strong(writing, me_ + 1)) return false;
    ring_host();
    return true;
  }

  // Takes the operation's entry, or joins the ranks that took it. Returns
  // whether the task moved; false while another operation holds the entry
  // (or it is being claimed).
  bool claim(DirectTask& t, bool* finished) {
    namespace es = entry_state;
    const int index = entry_of(t.key);
    HostEntry& e = seg_->entry(index);
    for (int attempt = 0; attempt < 64; ++attempt) {
      uint64_t s = e.state.load(std::memory_order_acquire);
      if (es::kind(s) == es::kFree) {
        const uint64_t gen = es::generation(s) + 1;
        if (!e.state.compare_exchange_strong(s,
                                             es::make(gen, es::kClaiming, 0, 0),
                                             std::memory_order_acq_rel)) {
          continue;
        }
        e.run_id.store(t.key.run_id, std::memory_order_relaxed);
        e.op_id.store(t.key.op_id, std::memory_order_relaxed);
        e.group.store(t.key.group, std::memory_order_relaxed);
        e.count.store(t.desc.count, std::memory_order_relaxed);
        e.slot_id.store(t.desc.slot_id, std::memory_order_relaxed);
        e.elem_type.store(static_cast<int32_t>(t.desc.type),
                          std::memory_order_relaxed);
        e.reduce_op.store(static_cast<int32_t>(t.desc.op),
                          std::memory_order_relaxed);
        e.world.store(t.desc.world_size, std::memory_order_relaxed);
        e.shape_digest.store(t.desc.shape_digest, std::memory_order_relaxed);
        e.joined_processes.store(uint64_t{1} << me_, std::memory_order_relaxed);
        e.departed_processes.store(0, std::memory_order_relaxed);
        for (auto& a : e.process_arrivals)
          a.store(0, std::memory_order_relaxed);
        e.arrivals.store(0, std::memory_order_relaxed);
        e.error[0] = '\0';
        // Release: a mark that reads this 0 then sees the new generation
        // (mark_failed takes itself back).
        e.failed_by.store(0, std::memory_order_release);
        e.state.store(es::make(gen, es::kActive, 1, 0),
                      std::memory_order_release);
        t.entry = index;
        t.stage = Stage::kCopyIn;
        ring_processes(t.processes);
        return true;
      }
      EntryFields held;
      uint64_t state;
      if (!snapshot(e, &held, &state) || held.run_id != t.key.run_id ||
          held.op_id != t.key.op_id || held.group != t.key.group ||
          es::joined(state) >= held.world) {
        // Another operation's, or being claimed, or every rank of it came
        // already: one key runs many times in one run (an allreduce in a
        // loop's body), and a rank done with one time that starts the next
        // while a peer still copies the first one's result out must not
        // join the first. Wait for the entry to be free. (With nothing to
        // move, a rank may leave before a peer joins, and its next time
        // then take that peer's place; no data moves, and the entry is
        // free once as many have left as joined.)
        break;
      }
      // Joins the operation whose fields were just read, if the entry is
      // still that claim's (the compare-and-swap fails otherwise).
      if (!e.state.compare_exchange_strong(
              state,
              es::make(es::generation(state), es::kActive,
                       es::joined(state) + 1, es::departed(state)),
              std::memory_order_acq_rel)) {
        continue;
      }
      e.joined_processes.fetch_or(uint64_t{1} << me_,
                                  std::memory_order_acq_rel);
      t.entry = index;
      if (!fields_agree(held, t.desc)) {
        const int peer =
            lowest_process(e.joined_processes.load() & ~(uint64_t{1} << me_));
        return fail(
            t, FailureKind::kMismatch, peer,
            "the ranks of one operation disagree: this process "
            "calls it with " +
                desc_of(t.desc) + ", process " + std::to_string(peer) +
                " with " + fields_desc(held) +
                shape_difference(t.desc.shape_digest, held.shape_digest),
            finished);
      }
      t.stage = Stage::kCopyIn;
      return true;
    }
    return waited_too_long(t,
                           "waited for another allreduce to leave the host "
                           "segment's entry this one needs",
                           finished);
  }

  // Runs the task as far as its peers allow. Returns whether it moved.
  bool advance(DirectTask& t, bool* finished) {
    bool moved = false;
    for (;;) {
      if (t.stage == Stage::kClaim) {
        if (!claim(t, finished)) return moved;
        if (*finished) return true;
        moved = true;
        continue;
      }
      HostEntry& e = seg_->entry(t.entry);
      const int32_t failed_by = e.failed_by.load(std::memory_order_acquire);
      if (failed_by > 0) return failed_elsewhere(t, finished);
      if (failed_by < 0) {  // a peer is writing why; its deadline still holds
        return waited_too_long(t, "waited for a peer to record why it failed",
                               finished) ||
               moved;
      }
      if (t.stage == Stage::kCopyIn && t.round == t.rounds) {
        return finish(t, std::nullopt, finished);
      }
      const int p = t.desc.world_size;
      // This rank's share of the chunk: [lo, hi) bytes. Its own input there
      // is read where it is, so it neither copies it in nor copies the
      // share's result out of the segment (see kWaitInputs).
      const int64_t esize = elem_bytes(t.desc.type);
      const int64_t bytes = chunk_bytes(t, t.round);
      const int64_t lo = bytes / esize * t.rank / p * esize;
      const int64_t hi = bytes / esize * (t.rank + 1) / p * esize;
      const char* in = t.in + t.round * seg_->chunk_bytes();
      char* out = t.out + t.round * seg_->chunk_bytes();
      char* result = seg_->slot(t.entry, seg_->ranks());
      if (t.stage == Stage::kCopyIn) {
        char* mine = seg_->slot(t.entry, t.rank);
        std::memcpy(mine, in, static_cast<size_t>(lo));
        std::memcpy(mine + hi, in + hi, static_cast<size_t>(bytes - hi));
        t.target = int64_t{p} * (2 * t.round + 1);
        t.stage = Stage::kWaitInputs;
        arrive(t);
        moved = true;
        continue;
      }
      if (e.arrivals.load(std::memory_order_acquire) < t.target) {
        if (waited_too_long(t, "waited for the other ranks' data", finished))
          return true;
        return moved;
      }
      if (t.stage == Stage::kWaitInputs) {
        // The share summed over the ranks in rank order (every rank's
        // result has the same bits), into the segment for the others and
        // this rank's output. The output may be the input: the input's
        // share is read before it is overwritten, and the rest of it was
        // copied into the slot already.
        if (hi > lo) {
          auto input = [&](int r) {
            return r == t.rank ? in + lo : seg_->slot(t.entry, r) + lo;
          };
          const int64_t n = (hi - lo) / esize;
          reduce(t.desc.type, t.desc.op, result + lo, input(0), input(1), n);
          for (int r = 2; r < p; ++r) {
            reduce(t.desc.type, t.desc.op, result + lo, result + lo, input(r),
                   n);
          }
          std::memcpy(out + lo, result + lo, static_cast<size_t>(hi - lo));
        }
        t.target = int64_t{p} * (2 * t.round + 2);
        t.stage = Stage::kWaitResult;
        arrive(t);
      } else {
        std::memcpy(out, result, static_cast<size_t>(lo));
        std::memcpy(out + hi, result + hi, static_cast<size_t>(bytes - hi));
        ++t.round;
        t.stage = Stage::kCopyIn;
      }
      moved = true;
    }
  }

  HostSegment* const seg_;
  const int me_;
  std::mutex mu_;
  std::deque<DirectTask> incoming_;
  int64_t pending_ = 0;
};

std::mutex& worker_mu() {
  static std::mutex* mu = new std::mutex();
  return *mu;
}
// One worker per local rank of an operation (its place among the ranks of
// this process), each a thread: a process of several devices copies and
// reduces for them at once, as their threads do in one process, instead of
// one after the other. Leaked on purpose, like the other workers.
std::vector<DirectWorker*>& workers() {
  static auto* w = new std::vector<DirectWorker*>();
  return *w;
}

// The rank's place among the operation's ranks that run in process me.
size_t local_index(const std::vector<int>& process_of_rank, int rank, int me) {
  size_t before = 0;
  for (int r = 0; r < rank; ++r) before += process_of_rank[r] == me;
  return before;
}

}  // namespace

void host_direct_allreduce(const OpKey& key, const OpDesc& desc, int rank,
                           const std::vector<int>& process_of_rank,
                           const void* in, void* out, double timeout_s,
                           Completion done) {
  HostSegment* seg = host_segment();
  const int me = host_segment_process();
  if (seg == nullptr) {
    done(
        tagged(FailureKind::kInvalid, -1,
               "jaxring allreduce: algorithm=direct across processes needs the "
               "host segment, which this process does not have: " +
                   host_segment_missing()));
    return;
  }
  std::vector<int> processes, ranks_of;
  for (int r = 0;
       r < desc.world_size && r < static_cast<int>(process_of_rank.size());
       ++r) {
    const int q = process_of_rank[r];
    const auto at = std::find(processes.begin(), processes.end(), q);
    if (at == processes.end()) {
      processes.push_back(q);
      ranks_of.push_back(1);
    } else {
      ++ranks_of[at - processes.begin()];
    }
  }
  const bool fits =
      desc.world_size >= 2 && desc.world_size <= seg->ranks() && rank >= 0 &&
      rank < desc.world_size &&
      static_cast<int>(process_of_rank.size()) >= desc.world_size &&
      std::all_of(
          processes.begin(), processes.end(),
          [&](int q) { return q >= 0 && q < seg->processes(); });
  if (!fits) {
    done(tagged(
        FailureKind::kInvalid, -1,
        "jaxring allreduce: algorithm=direct across processes runs among "
        "the processes of one host, at most " +
            std::to_string(seg->ranks()) + " ranks; this operation has " +
            std::to_string(desc.world_size)));
    return;
  }
  DirectTask t;
  t.key = key;
  t.desc = desc;
  t.rank = rank;
  t.processes = std::move(processes);
  t.ranks_of = std::move(ranks_of);
  t.in = static_cast<const char*>(in);
  t.out = static_cast<char*>(out);
  t.timeout_s = timeout_s;
  t.deadline = after_seconds(timeout_s);
  t.done = std::move(done);
  const int64_t total = desc.count * elem_bytes(desc.type);
  t.rounds = (total + seg->chunk_bytes() - 1) / seg->chunk_bytes();
  // As the ring's results are: fresh pages fault in 512 times fewer.
  advise_huge_pages(out, total);
  DirectWorker* w;
  {
    const size_t index = local_index(process_of_rank, rank, me);
    std::lock_guard<std::mutex> lock(worker_mu());
    while (workers().size() <= index)
      workers().push_back(new DirectWorker(seg, me));
    w = workers()[index];
  }
  w->submit(std::move(t));
}

int64_t host_direct_pending() {
  std::lock_guard<std::mutex> lock(worker_mu());
  int64_t pending = 0;
  for (DirectWorker* w : workers()) pending += w->pending();
  return pending;
}

}  // namespace jaxring
