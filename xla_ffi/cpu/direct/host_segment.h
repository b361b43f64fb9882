// The host segment: one POSIX shared-memory segment that every process of
// a job on one host maps, on which they run the direct allreduce across
// processes (host_direct.h).
//
// Why it looks the way it does:
//  * Over pairwise links (shm_link.h) a ring of p processes makes 2(p-1)
//    handoffs per chunk, each a wake-up of a process that may be waiting
//    for a core, and copies every byte about five times. Here every rank
//    copies its input into its slot once, reduces its 1/p of the slots
//    into the result, and copies the result out: two synchronisations per
//    chunk, done with one shared counter.
//  * Operations are matched by identity, not order (independent allreduces
//    may start in different orders on different processes): an operation
//    takes the entry its op id hashes to, tagged with its identity, and
//    holds it until every rank has left; another operation that hashes
//    there waits for it. An entry changes hands only by compare-and-swap
//    on its state word (entry_state below). Nothing blocks a process's
//    worker, so no order of arrival deadlocks.
//  * Made like the links' segments: created O_EXCL with owner-only
//    permissions under a name with the job id and 128 random bits, every
//    page reserved up front (a full /dev/shm refuses the segment instead of
//    killing a process with SIGBUS), and unlinked by its creator once every
//    process of the host has mapped it (or failed to), so nothing of the job
//    stays in /dev/shm whatever happens after set-up. Before that, the
//    creator's way out removes it (shm_segment.h), and the creator's pid,
//    written at creation, lets a later job remove it where nothing could.
//  * Every process of the job reads what the others write here; indices and
//    sizes come from the local plan and from the header as it was when this
//    process checked it (never read again), and the text of a peer's error
//    is read bounded, so a broken peer can corrupt a result (as over any
//    link) but never make this process read or write outside the segment.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "cpu/shm_segment.h"

namespace jaxring {

// The most processes (and ranks) one host segment serves.
constexpr int kHostMaxProcesses = 64;
// Entries: operations that can hold the segment at once.
constexpr int kHostEntries = 8;
// The bytes a segment may reserve in /dev/shm at most; the chunk (a rank's
// slot per entry) shrinks to fit, down to kHostMinChunkBytes.
constexpr int64_t kHostSegmentBudget = int64_t{48} << 20;
constexpr int64_t kHostMaxChunkBytes = int64_t{1} << 20;
constexpr int64_t kHostMinChunkBytes = int64_t{64} << 10;

// An entry's state word: which claim of the entry it is and how far its
// operation is. It changes only by compare-and-swap, so a rank that read
// the entry's fields joins only if the word did not change meanwhile: the
// fields it read are those of the operation it joins. Bits 0-1: the kind;
// 2-9: ranks that joined; 10-17: ranks that left; 32-63: the generation,
// one more at every claim.
namespace entry_state {
enum Kind : uint64_t { kFree = 0, kClaiming = 1, kActive = 2 };
inline uint64_t kind(uint64_t s) { return s & 3; }
inline int joined(uint64_t s) { return static_cast<int>((s >> 2) & 0xff); }
inline int departed(uint64_t s) { return static_cast<int>((s >> 10) & 0xff); }
inline uint64_t generation(uint64_t s) { return s >> 32; }
inline uint64_t make(uint64_t generation, uint64_t kind, int joined,
                     int departed) {
  return generation << 32 | static_cast<uint64_t>(departed & 0xff) << 10 |
         static_cast<uint64_t>(joined & 0xff) << 2 | kind;
}
}  // namespace entry_state

// One operation's part of the segment. The fields below the state word
// are written by the claimer before it publishes the entry Active, and
// stay until the next claim; they are atomics only so that a reader racing
// a claim reads some value (which its compare-and-swap then discards).
struct HostEntry {
  std::atomic<uint64_t> state;
  // The operation's identity and what its ranks must agree on.
  std::atomic<int64_t> run_id, op_id, group, count;
  // The call site (OpDesc::slot_id), to tell a peer in another program.
  std::atomic<int64_t> slot_id;
  std::atomic<int32_t> elem_type, reduce_op, world;
  // OpDesc::shape_digest (0: unknown).
  std::atomic<uint32_t> shape_digest;
  // The processes whose ranks joined, and those of which a rank left, one
  // bit each.
  std::atomic<uint64_t> joined_processes, departed_processes;
  // Arrivals at the operation's barriers, over all ranks: barrier b is
  // passed once it reached world * (b + 1).
  alignas(64) std::atomic<int64_t> arrivals;
  // 0; -1 while a process writes its failure; else 1 + the process that
  // failed the operation for every rank, with its tagged message
  // (NUL-terminated, read bounded).
  std::atomic<int32_t> failed_by;
  char error[436];
  // Arrivals at the barriers per process, over its ranks: what a timeout
  // reads to name the processes a barrier still waits for.
  std::atomic<int32_t> process_arrivals[kHostMaxProcesses];
};

class HostSegment {
 public:
  ~HostSegment();
  HostSegment(const HostSegment&) = delete;
  HostSegment& operator=(const HostSegment&) = delete;

  // Creator side (the host's first process): a new segment for `processes`
  // processes running `ranks` ranks in all. nullptr with *error if /dev/shm
  // cannot hold it.
  static std::unique_ptr<HostSegment> create(const std::string& job_id,
                                             int process, int processes,
                                             int ranks, std::string* error);
  // Any other process of the host: maps the segment `name` names, which
  // must be one made for job_id, owned by this user, owner-only, of the
  // size its header says.
  static std::unique_ptr<HostSegment> open(const std::string& name,
                                           const std::string& job_id,
                                           int process, std::string* error);

  const std::string& name() const { return name_; }
  // Removes the name (creator; idempotent). The mappings stay valid.
  void unlink();
  // A SegmentReader for remove_stale_segments: the creator of the host
  // segment whose head this is.
  static bool read_creator(const std::string& name, const char* head,
                           size_t file_bytes, SegmentCreator* creator);

  // Read from the header once, when it was checked: a peer that rewrites
  // the header later changes nothing this process computes.
  int processes() const { return processes_; }
  int ranks() const { return ranks_; }
  int64_t chunk_bytes() const { return chunk_bytes_; }
  HostEntry& entry(int e);
  // Entry e's slot for rank r (r == ranks(): the result).
  char* slot(int e, int r);

  // The process's futex word: bumped (and woken) whenever something it may
  // wait for happened.
  std::atomic<uint32_t>& doorbell(int process);
  void ring(int process);
  // Sleeps until process's doorbell moves from `seen`, at most ns.
  void wait(int process, uint32_t seen, int64_t ns);

  // Whether process q has exited: checked on its pid (a pidfd where the
  // kernel has them), which it wrote here when it mapped the segment with
  // the id of its pid namespace. Processes not yet known, and those in
  // another pid namespace (whose pids mean nothing here), count as alive.
  // Any thread (the workers of the local ranks).
  bool exited(int q);
  int pid_of(int q) const;
  // Records this process's pid, counted in mapped().
  void note_mapped(int process);
  int mapped() const;
  // Starts watching every other process that mapped the segment (call once
  // all did): a process gone before then is never blamed on its pid.
  void watch_peers(int me);

  struct Header;

 private:
  HostSegment(std::string name, void* base, size_t bytes, bool owner,
              int processes, int ranks, int64_t chunk_bytes);

  const std::string name_;
  void* const base_;
  const size_t bytes_;
  bool named_;
  Header* header_;
  const int processes_;
  const int ranks_;
  const int64_t chunk_bytes_;
  std::mutex pid_mu_;        // guards pidfds_ and pids_ (opened lazily)
  std::vector<int> pidfds_;  // per process; -1: none (yet)
  std::vector<int> pids_;    // per process, as read when its pidfd was opened
};

// The name prefix of a job's host segments ("/jaxring-<job id hex>-host-").
std::string host_segment_prefix(const std::string& job_id);

// This process's host segment, once set up (nullptr before, or if it could
// not be), and why it is missing ("" when it is there).
HostSegment* host_segment();
std::string host_segment_missing();
void set_host_segment(std::unique_ptr<HostSegment> segment, int process,
                      const std::string& missing);
// This process's index, for the direct algorithm across processes.
int host_segment_process();

}  // namespace jaxring
