#include "tcp_out_link.h"

#include <unistd.h>

#include <thread>
#include <utility>

#include "plan_executor.h"
#include "socket_io.h"

namespace jaxring {

OutLink::OutLink(int process, int channel, std::string address,
                 JobIdentity identity, bool offer_shm,
                 std::function<void(const std::string&)> on_death,
                 std::function<void(const std::string&)> on_shm_unavailable)
    : process_(process), channel_(channel), address_(std::move(address)),
      identity_(std::move(identity)), offer_shm_(offer_shm),
      on_death_(std::move(on_death)),
      on_shm_unavailable_(std::move(on_shm_unavailable)) {
  std::thread([this] { loop(); }).detach();
}

bool OutLink::enqueue(OutFrame f) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (dead_) return false;
    queue_.push_back(std::move(f));
  }
  cv_.notify_one();
  return true;
}

OutLink::Sent OutLink::send_data(OutFrame f) {
  int fd;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (dead_) return Sent::kDead;
    const bool here = fd_ >= 0 && !writing_ && queue_.empty() && broken_.empty() &&
                      ring_ && ring_->carries(f.header.payload_bytes);
    if (!here) {
      queue_.push_back(std::move(f));
      cv_.notify_one();
      return Sent::kQueued;
    }
    writing_ = true;
    fd = fd_;
  }
  if (f.op->failed_flag.load()) {  // nobody waits for it any more
    std::lock_guard<std::mutex> lock(mu_);
    writing_ = false;
    if (!queue_.empty()) cv_.notify_one();
    return Sent::kWritten;
  }
  std::string error;
  // Never waits: a full ring gives up at once, with nothing written.
  const ShmRing::Put put = ring_->put(f.data, f.header.payload_bytes, fd, f.stall_s,
                                      [] { return false; }, &error);
  bool ok = put != ShmRing::Put::kFailed;
  const char* p = reinterpret_cast<const char*>(&f.header);
  size_t n = sizeof(f.header);
  if (put == ShmRing::Put::kDone) {
    ring_frames_by_caller_.fetch_add(1, std::memory_order_relaxed);
    f.header.kind = kShmData;
    ok = write_now(fd, p, n, &error);
  }
  Sent sent = Sent::kWritten;
  {
    std::lock_guard<std::mutex> lock(mu_);
    writing_ = false;
    if (!ok) {
      broken_ = error.empty() ? std::string("a write to the peer failed") : error;
    } else if (put == ShmRing::Put::kGaveUp) {
      queue_.push_front(std::move(f));  // queued meanwhile: behind it
      sent = Sent::kQueued;
    } else if (n > 0) {
      // The socket took part of the header: the link's thread writes the
      // rest, first, and releases the frame once it has left.
      f.header_rest = true;
      f.message.assign(p, n);
      queue_.push_front(std::move(f));
      sent = Sent::kQueued;
    }
    if (!queue_.empty() || !broken_.empty()) cv_.notify_one();
  }
  return sent;
}

std::vector<OutFrame> OutLink::take_frames_of(const PlanOp* op) {
  std::vector<OutFrame> taken;
  std::lock_guard<std::mutex> lock(mu_);
  for (auto it = queue_.begin(); it != queue_.end();) {
    if (it->op.get() == op && !it->header_rest) {
      taken.push_back(std::move(*it));
      it = queue_.erase(it);
    } else {
      ++it;
    }
  }
  return taken;
}

void release_send(const OutFrame& f) {
  if (f.abort_of) f.abort_of->aborts_in_flight.fetch_sub(1);
  if (!f.op) return;
  PlanWorker* w = nullptr;
  {
    std::lock_guard<std::mutex> lock(f.op->mu);
    auto it = f.op->locals.find(f.rank);
    if (it != f.op->locals.end()) {
      --it->second.outstanding_sends;
      w = it->second.worker;
    }
  }
  if (w) wake(w);
}

void OutLink::die(const std::string& why) {
  std::deque<OutFrame> dropped;
  {
    std::lock_guard<std::mutex> lock(mu_);
    dead_ = true;
    dropped.swap(queue_);
  }
  on_death_(why);
  for (const OutFrame& f : dropped) release_send(f);
}

int OutLink::open_connection() {
  std::string error;
  const int fd = connect_to(address_, kConnectTimeoutS, &error);
  if (fd < 0) {
    die(error);
    return -1;
  }
  const Clock::time_point deadline = after_seconds(kHandshakeTimeoutS);
  if (!connect_handshake(fd, identity_, process_, channel_, deadline, &error)) {
    ::close(fd);
    die(error);
    return -1;
  }
  if (offer_shm_) {
    std::string why;
    ring_ = ShmRing::create(identity_.job_id, identity_.process, process_, channel_, &why);
    if (!ring_) on_shm_unavailable_(why);
  }
  bool mapped = false;
  if (!offer_ring(fd, ring_.get(), deadline, &mapped, &error)) {
    ::close(fd);
    die(error);
    return -1;
  }
  if (!mapped) ring_.reset();  // the peer says why in its own log
  shared_memory_.store(mapped);
  return fd;
}

bool OutLink::write_through_ring(int fd, OutFrame& f, std::string* error) {
  const ShmRing::Put put = ring_->put(
      f.data, f.header.payload_bytes, fd, f.stall_s,
      [&] { return !f.op->failed_flag.load(); }, error);
  bool ok = put != ShmRing::Put::kFailed;
  if (put == ShmRing::Put::kDone) {
    ring_frames_by_link_thread_.fetch_add(1, std::memory_order_relaxed);
    f.header.kind = kShmData;
    const char* p = reinterpret_cast<const char*>(&f.header);
    size_t n = sizeof(f.header);
    ok = write_all(fd, p, n, f.stall_s, nullptr, error);
  }
  // Only now: a rank whose sends are all released may complete, and its
  // process exit, which must not happen before the header left (the data
  // alone, in the ring, never reaches the peer).
  release_send(f);
  return ok;
}

void OutLink::loop() {
  std::string error;
  const int fd = open_connection();
  if (fd < 0) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    fd_ = fd;
  }
  for (;;) {
    OutFrame f;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return !broken_.empty() || (!queue_.empty() && !writing_); });
      // This thread keeps writing_ from here on if the link dies, so that
      // no sender touches the closed connection.
      writing_ = true;
      if (!broken_.empty()) {
        error = broken_;
      } else {
        f = std::move(queue_.front());
        queue_.pop_front();
      }
    }
    if (!error.empty() || !write_frame(fd, f, &error)) {
      ::close(fd);
      die(error);
      return;
    }
    std::lock_guard<std::mutex> lock(mu_);
    writing_ = false;
  }
}

bool OutLink::write_frame(int fd, OutFrame& f, std::string* error) {
  if (f.header_rest) {
    const char* p = f.message.data();
    size_t n = f.message.size();
    const bool ok = write_all(fd, p, n, f.stall_s, nullptr, error);
    release_send(f);
    return ok;
  }
  if (f.op && f.op->failed_flag.load()) {  // nobody waits for it any more
    release_send(f);
    return true;
  }
  if (f.op && ring_ && ring_->carries(f.header.payload_bytes)) {
    return write_through_ring(fd, f, error);
  }
  const char* p = reinterpret_cast<const char*>(&f.header);
  size_t n = sizeof(f.header);
  if (!write_all(fd, p, n, f.stall_s, nullptr, error)) {
    release_send(f);
    return false;
  }
  const char* data = f.op ? f.data : f.message.data();
  size_t left = static_cast<size_t>(f.header.payload_bytes);
  // If the operation fails mid-frame, its rank must be free to complete:
  // finish the frame (the stream must stay whole) from a private copy.
  std::vector<char> copy;
  bool released = !f.op;
  auto on_slice = [&] {
    if (!released && f.op->failed_flag.load()) {
      copy.assign(data, data + left);
      data = copy.data();
      released = true;
      release_send(f);
    }
  };
  const bool ok = write_all(fd, data, left, f.stall_s, on_slice, error);
  if (!released || !f.op) release_send(f);
  return ok;
}

}  // namespace jaxring
