#include "cpu/direct/host_segment.h"

#include <linux/futex.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <mutex>
#include <new>

#include "cpu/shm_segment.h"

namespace jaxring {

namespace {

// The first word: "JRHOST" and the layout's version in the low 16 bits.
// Processes of different builds must not share a segment whose entries
// they lay out differently; the version tells them apart where the sizes
// agree. The first layout carried "SG" there, read as version 1. Version
// 2: entries count each process's arrivals and departures and carry the
// operands' shape digest; the header names its creator.
constexpr uint64_t kHostMagicPrefix = 0x4a52484f53540000ull;
constexpr uint64_t kHostMagicMask = 0xffffffffffff0000ull;
constexpr uint32_t kHostLayout = 2;
constexpr uint64_t kHostMagic = kHostMagicPrefix | kHostLayout;

// The layout version of a segment's first word, or 0 if it is not one of
// a host segment.
uint32_t host_layout_of(uint64_t magic) {
  if ((magic & kHostMagicMask) != kHostMagicPrefix) return 0;
  const uint32_t low = static_cast<uint32_t>(magic & 0xffff);
  return low == 0x5347 ? 1 : low;
}
constexpr size_t kHeaderBytes = 8192;
constexpr size_t kEntriesBytes = 8192;
constexpr size_t kJobIdBytes = 64;
// Per-process pid watch: not yet opened, cannot be watched (another pid
// namespace, or gone before set-up ended), or watched by kill(pid, 0).
constexpr int kPidUnopened = -1;
constexpr int kPidUnwatchable = -2;
constexpr int kPidByKill = -3;

struct Bell {
  std::atomic<uint32_t> word;
  char pad[60];
};

size_t layout_bytes(int ranks, int64_t chunk) {
  return kHeaderBytes + kEntriesBytes +
         static_cast<size_t>(kHostEntries) * static_cast<size_t>(ranks + 1) *
             static_cast<size_t>(chunk);
}

// The largest chunk (a multiple of 4 KiB, at most kHostMaxChunkBytes) whose
// segment fits the budget; 0 if even kHostMinChunkBytes does not.
int64_t chunk_for(int ranks) {
  const int64_t room =
      kHostSegmentBudget - static_cast<int64_t>(kHeaderBytes + kEntriesBytes);
  int64_t chunk = room / (int64_t{kHostEntries} * (ranks + 1));
  chunk = std::min(chunk, kHostMaxChunkBytes) / 4096 * 4096;
  return chunk < kHostMinChunkBytes ? 0 : chunk;
}

int pidfd_open(int pid) {
#ifdef SYS_pidfd_open
  return static_cast<int>(::syscall(SYS_pidfd_open, pid, 0));
#else
  errno = ENOSYS;
  return -1;
#endif
}

std::mutex& global_mu() {
  static std::mutex* mu = new std::mutex();
  return *mu;
}
// Leaked on purpose: workers may use the segment during interpreter exit.
HostSegment* g_segment = nullptr;
std::string* g_missing =
    new std::string("the transport between processes is not set up");
int g_process = -1;

}  // namespace

struct HostSegment::Header {
  uint64_t magic;
  uint64_t bytes;
  uint32_t job_bytes;
  int32_t processes;
  int32_t ranks;
  // The process that created the segment: its pid[] and pid_namespace[]
  // are written before the name is published, for remove_stale_segments.
  int32_t creator;
  int64_t chunk_bytes;
  char job[kJobIdBytes];
  std::atomic<int32_t> mapped;
  std::atomic<int32_t> pid[kHostMaxProcesses];
  std::atomic<uint64_t> pid_namespace[kHostMaxProcesses];
  alignas(64) Bell bells[kHostMaxProcesses];
};
static_assert(sizeof(HostSegment::Header) <= kHeaderBytes,
              "host segment header");
static_assert(sizeof(HostEntry) * kHostEntries <= kEntriesBytes,
              "host entries");
static_assert(std::atomic<int64_t>::is_always_lock_free &&
                  std::atomic<uint32_t>::is_always_lock_free,
              "the segment's atomics must work across processes");

std::string host_segment_prefix(const std::string& job_id) {
  return "/jaxring-" + hex(job_id) + "-host-";
}

HostSegment::HostSegment(std::string name, void* base, size_t bytes, bool owner,
                         int processes, int ranks, int64_t chunk_bytes)
    : name_(std::move(name)),
      base_(base),
      bytes_(bytes),
      named_(owner),
      header_(static_cast<Header*>(base)),
      processes_(processes),
      ranks_(ranks),
      chunk_bytes_(chunk_bytes) {
  pidfds_.assign(kHostMaxProcesses, kPidUnopened);
  pids_.assign(kHostMaxProcesses, 0);
}

HostSegment::~HostSegment() {
  unlink();
  for (int fd : pidfds_) {
    if (fd >= 0) ::close(fd);
  }
  ::munmap(base_, bytes_);
}

void HostSegment::unlink() {
  if (named_) unlink_segment(name_);
  named_ = false;
}

bool HostSegment::read_creator(const std::string& name, const char* head,
                               size_t file_bytes, SegmentCreator* creator) {
  static_assert(sizeof(Header) <= kSegmentHeadBytes,
                "the sweep reads the whole header");
  const Header* h = reinterpret_cast<const Header*>(head);
  const int processes = h->processes, ranks = h->ranks, c = h->creator;
  // Every layout so far keeps the fields read here in place, so segments
  // that older builds left are removed too.
  const uint32_t layout = host_layout_of(h->magic);
  if (layout < 1 || layout > kHostLayout || h->bytes != file_bytes ||
      h->job_bytes > kJobIdBytes || processes < 2 ||
      processes > kHostMaxProcesses || ranks < processes ||
      ranks > kHostMaxProcesses || c < 0 || c >= processes) {
    return false;
  }
  const int64_t chunk = chunk_for(ranks);
  if (chunk == 0 || h->chunk_bytes != chunk ||
      file_bytes != layout_bytes(ranks, chunk) ||
      !is_segment_name(
          name, host_segment_prefix(std::string(h->job, h->job_bytes)))) {
    return false;
  }
  creator->pid = h->pid[c].load();
  creator->pid_namespace = h->pid_namespace[c].load();
  return creator->pid > 0;
}

std::unique_ptr<HostSegment> HostSegment::create(const std::string& job_id,
                                                 int process, int processes,
                                                 int ranks,
                                                 std::string* error) {
  if (processes < 2 || processes > kHostMaxProcesses || ranks < processes ||
      ranks > kHostMaxProcesses || process < 0 || process >= processes ||
      job_id.size() > kJobIdBytes) {
    *error =
        "the host segment serves 2 to " + std::to_string(kHostMaxProcesses) +
        " processes and ranks; this host has " + std::to_string(processes) +
        " processes and " + std::to_string(ranks) + " ranks";
    return nullptr;
  }
  const int64_t chunk = chunk_for(ranks);
  if (chunk == 0) {
    *error = "too many ranks on this host for the host segment's budget";
    return nullptr;
  }
  const std::string name =
      random_segment_name(host_segment_prefix(job_id), error);
  if (name.empty()) return nullptr;
  const size_t bytes = layout_bytes(ranks, chunk);
  void* base = create_segment(name, bytes, "the host segment", error);
  if (base == nullptr) return nullptr;
  // The file is zero-filled: every entry is free, every counter 0.
  Header* h = new (base) Header();
  h->magic = kHostMagic;
  h->bytes = bytes;
  h->job_bytes = static_cast<uint32_t>(job_id.size());
  std::memcpy(h->job, job_id.data(), job_id.size());
  h->processes = processes;
  h->ranks = ranks;
  h->chunk_bytes = chunk;
  h->creator = process;
  for (int e = 0; e < kHostEntries; ++e) {
    new (static_cast<char*>(base) + kHeaderBytes + e * sizeof(HostEntry))
        HostEntry();
  }
  std::unique_ptr<HostSegment> s(
      new HostSegment(name, base, bytes, true, processes, ranks, chunk));
  s->note_mapped(process);
  return s;
}

std::unique_ptr<HostSegment> HostSegment::open(const std::string& name,
                                               const std::string& job_id,
                                               int process,
                                               std::string* error) {
  if (!is_segment_name(name, host_segment_prefix(job_id))) {
    *error = "the host segment's published name is not one of this job's";
    return nullptr;
  }
  size_t bytes = 0;
  void* base = open_segment(name, kHeaderBytes + kEntriesBytes,
                            "the host segment", &bytes, error);
  if (base == nullptr) return nullptr;
  // Each value read once, checked, and kept: the header is shared.
  const volatile Header* h = static_cast<const volatile Header*>(base);
  const uint32_t layout = host_layout_of(h->magic);
  if (layout != 0 && layout != kHostLayout) {
    ::munmap(base, bytes);
    *error = "the host segment " + name + " has layout version " +
             std::to_string(layout) +
             " and this jaxring build lays it out as version " +
             std::to_string(kHostLayout) +
             ": every process of the job must run the "
             "same jaxring build";
    return nullptr;
  }
  const int processes = h->processes, ranks = h->ranks;
  const int64_t chunk = h->chunk_bytes;
  char job[kJobIdBytes];
  for (size_t i = 0; i < kJobIdBytes; ++i) job[i] = h->job[i];
  const bool fits =
      h->magic == kHostMagic && h->bytes == bytes &&
      h->job_bytes == job_id.size() &&
      std::memcmp(job, job_id.data(), job_id.size()) == 0 && processes >= 2 &&
      processes <= kHostMaxProcesses && ranks >= processes &&
      ranks <= kHostMaxProcesses && process >= 0 && process < processes &&
      chunk == chunk_for(ranks) && bytes == layout_bytes(ranks, chunk);
  if (!fits) {
    ::munmap(base, bytes);
    *error = "the host segment " + name +
             " is not this job's, or not laid out "
             "as this build lays it out";
    return nullptr;
  }
  std::unique_ptr<HostSegment> s(
      new HostSegment(name, base, bytes, false, processes, ranks, chunk));
  s->note_mapped(process);
  return s;
}

HostEntry& HostSegment::entry(int e) {
  return *reinterpret_cast<HostEntry*>(static_cast<char*>(base_) +
                                       kHeaderBytes + e * sizeof(HostEntry));
}

char* HostSegment::slot(int e, int r) {
  const size_t per_entry = static_cast<size_t>(ranks_ + 1) * chunk_bytes_;
  return static_cast<char*>(base_) + kHeaderBytes + kEntriesBytes +
         static_cast<size_t>(e) * per_entry +
         static_cast<size_t>(r) * chunk_bytes_;
}

std::atomic<uint32_t>& HostSegment::doorbell(int process) {
  return header_->bells[process].word;
}

void HostSegment::ring(int process) {
  std::atomic<uint32_t>& w = doorbell(process);
  w.fetch_add(1, std::memory_order_acq_rel);
  // Not FUTEX_PRIVATE: the word is shared with other processes.
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(&w), FUTEX_WAKE, 1 << 30,
            nullptr, nullptr, 0);
}

void HostSegment::wait(int process, uint32_t seen, int64_t ns) {
  timespec ts{static_cast<time_t>(ns / 1'000'000'000),
              static_cast<long>(ns % 1'000'000'000)};
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(&doorbell(process)),
            FUTEX_WAIT, seen, &ts, nullptr, 0);
}

void HostSegment::note_mapped(int process) {
  header_->pid_namespace[process].store(pid_namespace());
  header_->pid[process].store(static_cast<int32_t>(::getpid()));
  header_->mapped.fetch_add(1);
}

int HostSegment::mapped() const { return header_->mapped.load(); }

int HostSegment::pid_of(int q) const {
  return q >= 0 && q < processes_ ? header_->pid[q].load() : 0;
}

bool HostSegment::exited(int q) {
  if (q < 0 || q >= processes_) return false;
  std::lock_guard<std::mutex> lock(pid_mu_);
  int& fd = pidfds_[q];
  if (fd == kPidUnopened) {
    const int pid = pid_of(q);
    if (pid <= 0) return false;  // not mapped yet
    pids_[q] = pid;
    if (header_->pid_namespace[q].load() != pid_namespace()) {
      fd = kPidUnwatchable;  // its pid names another process here, or none
    } else {
      fd = pidfd_open(pid);
      // ENOSYS: an old kernel (watch by kill); ESRCH: gone before set-up
      // ended, which the deadline catches.
      if (fd < 0)
        fd = errno == ENOSYS && ::kill(pid, 0) == 0 ? kPidByKill
                                                    : kPidUnwatchable;
    }
  }
  if (fd == kPidUnwatchable) return false;
  if (fd == kPidByKill) return ::kill(pids_[q], 0) != 0 && errno == ESRCH;
  pollfd p{fd, POLLIN, 0};
  return ::poll(&p, 1, 0) > 0;
}

void HostSegment::watch_peers(int me) {
  for (int q = 0; q < processes_; ++q) {
    if (q != me) (void)exited(q);
  }
}

HostSegment* host_segment() {
  std::lock_guard<std::mutex> lock(global_mu());
  return g_segment;
}

std::string host_segment_missing() {
  std::lock_guard<std::mutex> lock(global_mu());
  return *g_missing;
}

int host_segment_process() {
  std::lock_guard<std::mutex> lock(global_mu());
  return g_process;
}

void set_host_segment(std::unique_ptr<HostSegment> segment, int process,
                      const std::string& missing) {
  std::lock_guard<std::mutex> lock(global_mu());
  if (g_segment != nullptr) return;  // set once; the first one stays mapped
  g_segment = segment.release();
  g_process = process;
  *g_missing = g_segment != nullptr ? "" : missing;
}

}  // namespace jaxring
