#include "cpu/net/shm_link.h"

#include <linux/futex.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <new>

#include "cpu/shm_segment.h"
#include "cpu/net/socket_io.h"

namespace jaxring {

namespace {

// The control block's room at the start of the segment (the data starts
// page-aligned after it).
constexpr size_t kControlBytes = 4096;
constexpr uint64_t kControlMagic = 0x4a52494e47524e47ull;  // "JRINGRNG"
// How long a full ring's sender sleeps between looks at its peer and its
// operation (the receiver wakes it earlier when it frees room).
constexpr int64_t kRoomWaitNs = 2'000'000;

std::string link_prefix(const std::string& job_id, int from, int to,
                        int channel) {
  return ShmRing::job_prefix(job_id) + std::to_string(from) + "-" +
         std::to_string(to) + "-" + std::to_string(channel) + "-";
}

size_t map_bytes_for(int64_t capacity) {
  return kControlBytes + static_cast<size_t>(capacity);
}

void futex_wait(std::atomic<uint32_t>* word, uint32_t seen, int64_t ns) {
  timespec ts{static_cast<time_t>(ns / 1'000'000'000),
              static_cast<long>(ns % 1'000'000'000)};
  // Not FUTEX_PRIVATE: the word is shared with another process.
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, seen, &ts,
            nullptr, 0);
}

void futex_wake(std::atomic<uint32_t>* word) {
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, 1,
            nullptr, nullptr, 0);
}

// Whether the peer's end of the connection is gone (or it sent something on
// a connection it only reads: equally a broken peer).
bool peer_closed(int fd) {
  pollfd p{fd, static_cast<short>(POLLIN | POLLRDHUP), 0};
  return ::poll(&p, 1, 0) > 0 &&
         (p.revents & (POLLIN | POLLRDHUP | POLLHUP | POLLERR));
}

}  // namespace

struct ShmRing::Control {
  uint64_t magic;
  uint64_t capacity;
  // Ring positions grow without wrapping (int64 bytes last forever); the
  // byte at position x lives at data[x % capacity].
  alignas(64) std::atomic<int64_t> written;   // by the sender
  alignas(64) std::atomic<int64_t> consumed;  // by the receiver
  // Bumped by the receiver on every release: what a sender waiting for
  // room sleeps on.
  alignas(64) std::atomic<uint32_t> consumed_seq;
  std::atomic<uint32_t> sender_waiting;
  // Written at creation, for remove_stale_segments.
  alignas(64) std::atomic<int32_t> creator_pid;
  std::atomic<uint64_t> creator_pid_namespace;
};
static_assert(sizeof(ShmRing::Control) <= kControlBytes, "control block");
static_assert(std::atomic<int64_t>::is_always_lock_free &&
                  std::atomic<uint32_t>::is_always_lock_free,
              "the control block's atomics must work across processes");

std::string ShmRing::job_prefix(const std::string& job_id) {
  return "/jaxring-" + hex(job_id) + "-";
}

ShmRing::ShmRing(std::string name, int64_t capacity, void* base,
                 size_t map_bytes, bool owner)
    : name_(std::move(name)),
      capacity_(capacity),
      base_(base),
      map_bytes_(map_bytes),
      named_(owner),
      control_(static_cast<Control*>(base)),
      data_(static_cast<char*>(base) + kControlBytes) {}

ShmRing::~ShmRing() {
  unlink();
  ::munmap(base_, map_bytes_);
}

void ShmRing::unlink() {
  if (named_) unlink_segment(name_);
  named_ = false;
}

bool ShmRing::read_creator(const std::string& name, const char* head,
                           size_t file_bytes, SegmentCreator* creator) {
  static_assert(sizeof(Control) <= kSegmentHeadBytes,
                "the sweep reads the whole block");
  (void)
      name;  // its job, link and channel are not in the block to check against
  const Control* c = reinterpret_cast<const Control*>(head);
  if (c->magic != kControlMagic ||
      c->capacity != static_cast<uint64_t>(kShmRingBytes) ||
      file_bytes != map_bytes_for(kShmRingBytes)) {
    return false;
  }
  creator->pid = c->creator_pid.load();
  creator->pid_namespace = c->creator_pid_namespace.load();
  return creator->pid > 0;
}

std::unique_ptr<ShmRing> ShmRing::create(const std::string& job_id, int from,
                                         int to, int channel,
                                         std::string* error) {
  const std::string name =
      random_segment_name(link_prefix(job_id, from, to, channel), error);
  if (name.empty()) return nullptr;
  const size_t bytes = map_bytes_for(kShmRingBytes);
  void* base = create_segment(name, bytes, "a shared-memory link", error);
  if (base == nullptr) return nullptr;
  Control* c = new (base) Control();
  c->magic = kControlMagic;
  c->capacity = static_cast<uint64_t>(kShmRingBytes);
  c->written.store(0);
  c->consumed.store(0);
  c->creator_pid_namespace.store(pid_namespace());
  c->creator_pid.store(static_cast<int32_t>(::getpid()));
  return std::unique_ptr<ShmRing>(
      new ShmRing(name, kShmRingBytes, base, bytes, true));
}

std::unique_ptr<ShmRing> ShmRing::open(const ShmOffer& offer,
                                       const std::string& job_id, int from,
                                       int to, int channel,
                                       std::string* error) {
  const std::string prefix = link_prefix(job_id, from, to, channel);
  if (offer.name_bytes >= sizeof(offer.name) ||
      offer.capacity != static_cast<uint64_t>(kShmRingBytes)) {
    *error = "a malformed shared-memory offer";
    return nullptr;
  }
  const std::string name(offer.name, offer.name_bytes);
  if (!is_segment_name(name, prefix)) {
    *error = "a shared-memory offer names a segment not of this link";
    return nullptr;
  }
  size_t bytes = 0;
  void* base = open_segment(name, map_bytes_for(kShmRingBytes),
                            "the shared-memory segment", &bytes, error);
  if (base == nullptr) return nullptr;
  if (bytes != map_bytes_for(kShmRingBytes)) {
    ::munmap(base, bytes);
    *error =
        "the shared-memory segment " + name + " is not of the offered size";
    return nullptr;
  }
  const Control* c = static_cast<const Control*>(base);
  if (c->magic != kControlMagic ||
      c->capacity != static_cast<uint64_t>(kShmRingBytes)) {
    ::munmap(base, bytes);
    *error = "the shared-memory segment is not a jaxring ring";
    return nullptr;
  }
  return std::unique_ptr<ShmRing>(
      new ShmRing(name, kShmRingBytes, base, bytes, false));
}

ShmOffer ShmRing::offer() const {
  ShmOffer o{};
  o.magic = kShmOfferMagic;
  o.name_bytes = static_cast<uint32_t>(name_.size());
  o.capacity = static_cast<uint64_t>(capacity_);
  std::memcpy(o.name, name_.data(), name_.size());
  return o;
}

int64_t ShmRing::placement_of(int64_t end, int64_t n) const {
  const int64_t at = end % capacity_;
  return at + n > capacity_ ? end + (capacity_ - at) : end;
}

ShmRing::Put ShmRing::put(const char* data, int64_t n, int peer_fd,
                          double stall_s,
                          const std::function<bool()>& keep_waiting,
                          std::string* error) {
  const int64_t start = placement_of(local_end_, n);
  const int64_t end = start + n;
  int64_t last_consumed = -1;
  Clock::time_point stall_deadline = after_seconds(stall_s);
  for (;;) {
    const uint32_t seq = control_->consumed_seq.load(std::memory_order_acquire);
    const int64_t consumed = control_->consumed.load(std::memory_order_acquire);
    if (consumed < 0 || consumed > local_end_) {
      *error =
          "protocol error: the peer's shared-memory ring reports bytes it "
          "was never sent";
      return Put::kFailed;
    }
    if (end - consumed <= capacity_) break;
    if (consumed != last_consumed) {
      last_consumed = consumed;
      stall_deadline = after_seconds(stall_s);
    }
    if (!keep_waiting()) return Put::kGaveUp;
    if (peer_closed(peer_fd)) {
      *error = "the peer closed the connection";
      return Put::kFailed;
    }
    if (Clock::now() > stall_deadline) {
      *error = "the peer freed no room in its shared-memory ring for " +
               std::to_string(stall_s) + " s";
      return Put::kFailed;
    }
    control_->sender_waiting.store(1, std::memory_order_seq_cst);
    if (control_->consumed.load(std::memory_order_seq_cst) == consumed) {
      futex_wait(&control_->consumed_seq, seq, kRoomWaitNs);
    }
    control_->sender_waiting.store(0, std::memory_order_relaxed);
  }
  std::memcpy(data_ + start % capacity_, data, static_cast<size_t>(n));
  local_end_ = end;
  control_->written.store(end, std::memory_order_release);
  return Put::kDone;
}

const char* ShmRing::next(int64_t n, std::string* error) {
  const int64_t start = placement_of(local_end_, n);
  if (!carries(n) ||
      control_->written.load(std::memory_order_acquire) < start + n) {
    *error =
        "protocol error: a frame announces shared-memory data its sender "
        "did not write";
    return nullptr;
  }
  return data_ + start % capacity_;
}

void ShmRing::release(int64_t n) {
  local_end_ = placement_of(local_end_, n) + n;
  control_->consumed.store(local_end_, std::memory_order_seq_cst);
  control_->consumed_seq.fetch_add(1, std::memory_order_seq_cst);
  if (control_->sender_waiting.load(std::memory_order_seq_cst)) {
    futex_wake(&control_->consumed_seq);
  }
}

bool offer_ring(int fd, ShmRing* ring, Clock::time_point deadline, bool* mapped,
                std::string* error) {
  ShmOffer offer{};
  offer.magic = kShmOfferMagic;
  if (ring) offer = ring->offer();
  const char* p = reinterpret_cast<const char*>(&offer);
  size_t n = sizeof(offer);
  uint32_t answer = kShmDeclined;
  const double budget_s =
      std::chrono::duration<double>(deadline - Clock::now()).count();
  const bool ok =
      write_all(fd, p, n, std::max(budget_s, 0.001), nullptr, error) &&
      read_exact_by(fd, reinterpret_cast<char*>(&answer), sizeof(answer),
                    deadline, error) == ReadResult::kOk;
  if (ring) ring->unlink();  // mapped by the peer, or never will be
  *mapped = ok && ring && answer == kShmMapped;
  if (ok && answer != kShmMapped && answer != kShmDeclined) {
    *error = "protocol error: a bad answer to the shared-memory offer";
    return false;
  }
  return ok;
}

bool answer_offer(int fd, bool accept, const std::string& job_id, int from,
                  int to, int channel, Clock::time_point deadline,
                  std::unique_ptr<ShmRing>* ring, std::string* declined_why,
                  std::string* error) {
  ShmOffer offer{};
  if (read_exact_by(fd, reinterpret_cast<char*>(&offer), sizeof(offer),
                    deadline, error) != ReadResult::kOk) {
    return false;
  }
  if (offer.magic != kShmOfferMagic) {
    *error = "protocol error: no shared-memory offer after the handshake";
    return false;
  }
  if (offer.name_bytes > 0) {
    if (accept) {
      *ring = ShmRing::open(offer, job_id, from, to, channel, declined_why);
    } else {
      *declined_why = "JAXRING_TRANSPORT=tcp in this process";
    }
  }
  const uint32_t answer = *ring ? kShmMapped : kShmDeclined;
  const char* p = reinterpret_cast<const char*>(&answer);
  size_t n = sizeof(answer);
  const double budget_s =
      std::chrono::duration<double>(deadline - Clock::now()).count();
  if (!write_all(fd, p, n, std::max(budget_s, 0.001), nullptr, error)) {
    ring->reset();
    return false;
  }
  return true;
}

}  // namespace jaxring
