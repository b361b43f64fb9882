// The sending side of the TCP transport: one connection per (destination
// process, ring channel), opened on first use, with a sender thread that
// writes its queue of frames in order. To a process on the same host the
// payload of data frames goes through a shared-memory ring (shm_link.h)
// instead, when the peer maps it; the headers stay on the connection.
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "plan_op.h"
#include "shm_link.h"
#include "tcp_handshake.h"
#include "wire_format.h"

namespace jaxring {

// How long a connection may take to open, and an abort frame to leave.
constexpr double kConnectTimeoutS = 30.0;
constexpr double kAbortSendTimeoutS = 10.0;
// How long a connection has to prove itself (either end of the handshake).
constexpr double kHandshakeTimeoutS = 10.0;

// A frame waiting to be written to one connection.
struct OutFrame {
  FrameHeader header{};  // zeroed: no stray bytes of this process on the wire
  const char* data = nullptr;  // points into a local rank's buffer
  std::shared_ptr<PlanOp> op;   // null for abort frames
  std::shared_ptr<PlanOp> abort_of;  // an abort frame's operation
  int rank = -1;               // whose outstanding_sends this holds
  std::string message;         // an abort frame's payload
  double stall_s = kAbortSendTimeoutS;
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
  // Takes op's data frames out of the queue. A frame being written stays
  // (the stream must stay whole); the loop finishes it from a copy.
  std::vector<OutFrame> take_frames_of(const PlanOp* op);
  // Whether data goes through a shared-memory ring the peer mapped.
  bool shared_memory() const { return shared_memory_.load(); }

 private:
  void loop();
  // Opens and proves the connection and settles the ring; -1 on failure
  // (the link died).
  int open_connection();
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
  std::unique_ptr<ShmRing> ring_;  // the link's thread only
  std::atomic<bool> shared_memory_{false};
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<OutFrame> queue_;
  bool dead_ = false;
};

}  // namespace jaxring
