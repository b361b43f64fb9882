// The sending side of the TCP transport: one connection per (destination
// process, ring channel), opened on first use, with a sender thread that
// writes its queue of frames in order. To a process on the same host the
// payload of data frames goes through a shared-memory ring (shm_link.h)
// instead, when the peer maps it; the headers stay on the connection.
//
// A data frame is written by the thread that sends it (the device's
// worker) when nothing is queued before it: on a machine with fewer cores
// than threads, each handoff to the sender thread is a wake-up that waits
// for a core, on every hop of every ring. Whatever would wait (a full ring,
// a socket that takes only part of the frame, a broken connection) goes to
// the sender thread instead, so the calling thread never blocks on the
// peer.
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "cpu/plan/plan_op.h"
#include "cpu/net/shm_link.h"
#include "cpu/net/tcp_handshake.h"
#include "cpu/net/frames.h"

namespace jaxring {

// How long a connection may take to open, and an abort frame to leave.
constexpr double kConnectTimeoutS = 30.0;
constexpr double kAbortSendTimeoutS = 10.0;
// How long a connection has to prove itself (either end of the handshake).
constexpr double kHandshakeTimeoutS = 10.0;

// A frame waiting to be written to one connection.
struct OutFrame {
  FrameHeader header{};  // zeroed: no stray bytes of this process on the wire
  const char* data = nullptr;        // points into a local rank's buffer
  std::shared_ptr<PlanOp> op;        // null for abort frames
  std::shared_ptr<PlanOp> abort_of;  // an abort frame's operation
  int rank = -1;                     // whose outstanding_sends this holds
  std::string message;               // an abort frame's payload
  double stall_s = kAbortSendTimeoutS;
  // Bytes of the frame (its header, then its payload unless that went
  // through the ring) the sending thread already wrote: the link's thread
  // writes the rest before anything else, even if the operation failed (the
  // stream must stay whole).
  int64_t written = 0;

  // Whether part of the frame has gone: some bytes on the socket, or its
  // payload into the ring (then its header must follow).
  bool begun() const { return written > 0 || header.kind == kShmData; }
};

// The frame no longer reads the rank's buffer (written, or dropped): the
// rank's count of outstanding sends goes down and its worker is woken.
void release_send(const OutFrame& f);

class OutLink {
 public:
  // on_death(why) runs once, on the link's thread, if the connection cannot
  // be opened, proved, or written. offer_shm: the process runs on this host
  // (as far as the job's records tell), so a shared-memory ring is offered;
  // on_shm_unavailable(why) runs if this process cannot make one.
  OutLink(int process, int channel, std::string address, JobIdentity identity,
          bool offer_shm, std::function<void(const std::string&)> on_death,
          std::function<void(const std::string&)> on_shm_unavailable);
  // Returns false if the link is already dead (the frame is not taken).
  bool enqueue(OutFrame f);
  // A data frame: written on the calling thread if it can be without
  // waiting (kWritten: the frame no longer reads the rank's buffer and
  // release_send is not called for it), else queued (kQueued) as enqueue
  // does. Takes no operation's lock.
  enum class Sent { kWritten, kQueued, kDead };
  Sent send_data(OutFrame f);
  // Takes op's data frames out of the queue. A frame being written stays
  // (the stream must stay whole), and so does one its sender began; the
  // loop finishes them from a copy.
  std::vector<OutFrame> take_frames_of(const PlanOp* op);
  // Whether data goes through a shared-memory ring the peer mapped.
  bool shared_memory() const { return shared_memory_.load(); }
  // Data frames written so far by send_data's caller, and (wholly or in
  // part) by the link's thread.
  int64_t frames_by_caller() const { return frames_by_caller_.load(); }
  int64_t frames_by_link_thread() const {
    return frames_by_link_thread_.load();
  }
  // Of the latter, those send_data's caller began and the link's thread
  // finished (a socket that took part of the frame, or a ring payload whose
  // header it did not take).
  int64_t frames_finished_for_caller() const {
    return frames_finished_for_caller_.load();
  }

 private:
  void loop();
  // Opens and proves the connection and settles the ring; -1 on failure
  // (the link died).
  int open_connection();
  // Writes one frame of the queue (and releases it); false with *error if
  // the link must die.
  bool write_frame(int fd, OutFrame& f, std::string* error);
  // Writes what the socket takes now of a data frame (its header only if
  // its payload is in the ring), counting it in f.written; false with
  // *error if the connection broke.
  bool write_frame_now(int fd, OutFrame& f, std::string* error);
  // Writes one data frame whose payload fits the ring; false with *error
  // if the link must die.
  bool write_through_ring(int fd, OutFrame& f, std::string* error);
  void die(const std::string& why);

  const int process_;
  const int channel_;
  const std::string address_;
  const JobIdentity identity_;
  const bool offer_shm_;
  const std::function<void(const std::string&)> on_death_;
  const std::function<void(const std::string&)> on_shm_unavailable_;
  // Written by whichever thread holds `writing_`; set before fd_.
  std::unique_ptr<ShmRing> ring_;
  std::atomic<bool> shared_memory_{false};
  std::atomic<int64_t> frames_by_caller_{0};
  std::atomic<int64_t> frames_by_link_thread_{0};
  std::atomic<int64_t> frames_finished_for_caller_{0};
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<OutFrame> queue_;
  bool dead_ = false;
  // Guarded by mu_: the open connection (-1 before), whether a thread is
  // writing to it (one at a time, so frames keep their order), and why a
  // write on a sending thread broke it (the link's thread closes it and
  // runs the death's handlers, which are no work for a device's thread).
  int fd_ = -1;
  bool writing_ = false;
  std::string broken_;
};

}  // namespace jaxring
