// The shared-memory link between two processes of one job on the same host:
// a byte ring in a POSIX shared-memory segment that one sender (the process
// that opened the TCP connection) fills and one receiver (the process that
// accepted it) drains. It carries the payload of data frames; the TCP
// connection beside it keeps carrying every frame header, the aborts, and
// the news that the peer died.
//
// Why it looks the way it does:
//  * Over TCP loopback every byte is copied twice by the kernel, with a
//    system call per slice. Here the sender copies a chunk into the ring once,
//    and the receiver reduces it straight out of the ring into its result:
//    one copy per hop.
//  * Headers stay on the socket: the connection already orders the frames,
//    and its end is how a dead peer is noticed (the kernel closes a process's
//    sockets when it dies), so the ring needs no protocol of its own. Both
//    ends find a payload at the position they compute from the sizes of the
//    frames before it (placement_of); the sender publishes how far it wrote
//    before it sends the header, and the receiver checks it before reading.
//  * A segment is created O_EXCL with owner-only permissions, under a name
//    holding the job id and 128 random bits (nobody can guess it to squat
//    on it; the job secret is not in it because /dev/shm lists names to
//    every user), its pages reserved up front (a full /dev/shm refuses the
//    link instead of killing the process with SIGBUS on a write), and
//    unlinked by its creator as soon as the peer answered the offer: from
//    then on nothing of the job is left in /dev/shm, whatever happens.
//    Before then, the creator's exit handlers remove it, or a later job
//    does once the creator (its pid in the control block) is gone
//    (shm_segment.h).
//  * The receiver writes only the ring's consumed position; the sender
//    checks it against what it wrote before trusting it, and the receiver
//    checks the sender's written position the same way: a broken or hostile
//    peer gets a protocol error, never an access outside the segment.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "cpu/deadline.h"
#include "cpu/shm_segment.h"

namespace jaxring {

// Ring bytes per (sender, receiver, channel). Payloads larger than half of
// it travel on the socket (a ring must hold two to pipeline).
constexpr int64_t kShmRingBytes = int64_t{8} << 20;

// The offer the connector sends right after the handshake (an empty name:
// no offer), and the acceptor's one-word answer.
struct ShmOffer {
  uint32_t magic;
  uint32_t name_bytes;  // 0: this connection uses the socket only
  uint64_t capacity;
  char name[96];
};
static_assert(sizeof(ShmOffer) == 112, "ShmOffer layout");
constexpr uint32_t kShmOfferMagic = 0x4a52534d;  // "JRSM"
enum ShmAnswer : uint32_t { kShmDeclined = 0, kShmMapped = 1 };

class ShmRing {
 public:
  ~ShmRing();
  ShmRing(const ShmRing&) = delete;
  ShmRing& operator=(const ShmRing&) = delete;

  // Sender side: a new segment for the link from this process to `to` on
  // `channel`, named from job_id (raw bytes). nullptr with *error if it
  // cannot be made (no /dev/shm, too small, out of descriptors).
  static std::unique_ptr<ShmRing> create(const std::string& job_id, int from,
                                         int to, int channel,
                                         std::string* error);
  // Receiver side: maps the segment `offer` names, which must be one that
  // process `from` made for this process on `channel` in job job_id, owned
  // by this user, owner-only, of the offered size.
  static std::unique_ptr<ShmRing> open(const ShmOffer& offer,
                                       const std::string& job_id, int from,
                                       int to, int channel, std::string* error);
  // The name prefix every segment of the job has ("/jaxring-<job id hex>-").
  static std::string job_prefix(const std::string& job_id);

  // The offer naming this segment (sender side).
  ShmOffer offer() const;
  // Removes the name (sender side; idempotent). The mapping stays valid.
  void unlink();
  // A SegmentReader for remove_stale_segments: the creator of the ring
  // whose head this is.
  static bool read_creator(const std::string& name, const char* head,
                           size_t file_bytes, SegmentCreator* creator);

  int64_t capacity() const { return capacity_; }
  // Whether a payload of n bytes travels in the ring (else on the socket).
  bool carries(int64_t n) const { return n > 0 && n <= capacity_ / 2; }

  // Sender: waits until n more bytes fit, then copies them in and
  // publishes them. `keep_waiting` is polled while the ring is full (false:
  // give up, nothing was written); `peer_fd` is the connection, watched
  // for the peer's end. Returns false with *error when the peer vanished,
  // broke the ring's protocol, or freed nothing for stall_s.
  enum class Put { kDone, kGaveUp, kFailed };
  Put put(const char* data, int64_t n, int peer_fd, double stall_s,
          const std::function<bool()>& keep_waiting, std::string* error);

  // Receiver: the next payload of n bytes (the sender published it before
  // its header left), or nullptr with *error if the sender did not.
  const char* next(int64_t n, std::string* error);
  // Receiver: hands the bytes of the payload next() returned back to the
  // sender.
  void release(int64_t n);

  struct Control;  // at the start of the segment, shared

 private:
  ShmRing(std::string name, int64_t capacity, void* base, size_t map_bytes,
          bool owner);
  // Where a payload of n bytes goes when the ring's end is at `end`: at
  // `end`, or at the start of the next lap if it would wrap.
  int64_t placement_of(int64_t end, int64_t n) const;

  const std::string name_;
  const int64_t capacity_;
  void* const base_;
  const size_t map_bytes_;
  bool named_;  // the sender has not unlinked the name yet
  Control* control_;
  char* data_;
  int64_t local_end_ = 0;  // sender: published end; receiver: consumed end
};

// Connector side, right after the handshake: offers `ring` (nullptr: no
// offer) and reads the answer by `deadline`. The ring's name is unlinked
// whatever happens. Returns false with *error if the connection broke;
// else *mapped says whether the peer took the ring.
bool offer_ring(int fd, ShmRing* ring, Clock::time_point deadline, bool* mapped,
                std::string* error);

// Acceptor side: reads the connector's offer by `deadline` and, if `accept`
// and it names a segment process `from` made for this link, maps it
// (*ring) and says so; else declines (*declined_why says why when an offer
// was made). Returns false with *error if the connection broke or the
// offer is not one.
bool answer_offer(int fd, bool accept, const std::string& job_id, int from,
                  int to, int channel, Clock::time_point deadline,
                  std::unique_ptr<ShmRing>* ring, std::string* declined_why,
                  std::string* error);

}  // namespace jaxring
