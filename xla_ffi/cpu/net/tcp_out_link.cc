#include "cpu/net/tcp_out_link.h"

#include <unistd.h>

#include <algorithm>
#include <thread>
#include <utility>

#include "cpu/plan/plan_executor.h"
#include "cpu/net/socket_io.h"

namespace jaxring {

OutLink::OutLink(int process, int channel, std::string address,
                 JobIdentity identity, bool offer_shm,
                 std::function<void(const std::string&)> on_death,
                 std::function<void(const std::string&)> on_shm_unavailable)
    : process_(process),
      channel_(channel),
      address_(std::move(address)),
      identity_(std::move(identity)),
      offer_shm_(offer_shm),
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
    if (fd_ < 0 || writing_ || !queue_.empty() || !broken_.empty()) {
      queue_.push_back(std::move(f));
      cv_.notify_one();
      return Sent::kQueued;
    }
    writing_ = true;
    fd = fd_;
  }
  std::string error;
  bool ok = true;
  bool taken = true;  // the frame went whole (or is not to go at all)
  const bool dropped = f.op->failed_flag.load();  // as the link's thread would
  if (dropped) {
    // Nobody waits for it any more.
  } else if (ring_ && ring_->carries(f.header.payload_bytes)) {
    // Never waits: a full ring gives up at once, with nothing written.
    const ShmRing::Put put = ring_->put(
        f.data, f.header.payload_bytes, fd, f.stall_s, [] { return false; },
        &error);
    ok = put != ShmRing::Put::kFailed;
    taken = false;
    if (put == ShmRing::Put::kDone) {
      f.header.kind = kShmData;  // the payload is in the ring: the header goes
      ok = write_frame_now(fd, f, &error);
      taken = ok && f.written == static_cast<int64_t>(sizeof(f.header));
    }
  } else {
    ok = write_frame_now(fd, f, &error);
    taken = ok && f.written == static_cast<int64_t>(sizeof(f.header)) +
                                   f.header.payload_bytes;
  }
  if (ok && taken && !dropped)
    frames_by_caller_.fetch_add(1, std::memory_order_relaxed);
  {
    std::lock_guard<std::mutex> lock(mu_);
    writing_ = false;
    if (!ok) {
      broken_ =
          error.empty() ? std::string("a write to the peer failed") : error;
    } else if (!taken) {
      // The ring was full, or the socket took only part of the frame: the
      // link's thread writes the rest, first (whatever was queued meanwhile
      // comes after), and releases the frame once it has left.
      queue_.push_front(std::move(f));
    }
    if (!queue_.empty() || !broken_.empty()) cv_.notify_one();
  }
  return !ok || taken ? Sent::kWritten : Sent::kQueued;
}

bool OutLink::write_frame_now(int fd, OutFrame& f, std::string* error) {
  const char* p = reinterpret_cast<const char*>(&f.header);
  size_t n = sizeof(f.header);
  if (!write_now(fd, p, n, error)) return false;
  f.written = static_cast<int64_t>(sizeof(f.header) - n);
  if (n > 0 || f.header.kind == kShmData) return true;
  const char* data = f.data;
  size_t left = static_cast<size_t>(f.header.payload_bytes);
  if (!write_now(fd, data, left, error)) return false;
  f.written += f.header.payload_bytes - static_cast<int64_t>(left);
  return true;
}

std::vector<OutFrame> OutLink::take_frames_of(const PlanOp* op) {
  std::vector<OutFrame> taken;
  std::lock_guard<std::mutex> lock(mu_);
  for (auto it = queue_.begin(); it != queue_.end();) {
    if (it->op.get() == op && !it->begun()) {
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
    ring_ = ShmRing::create(identity_.job_id, identity_.process, process_,
                            channel_, &why);
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
      cv_.wait(lock, [&] {
        return !broken_.empty() || (!queue_.empty() && !writing_);
      });
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
  // A frame begun by the thread that sent it is finished whatever happened
  // to its operation meanwhile: the stream must stay whole.
  if (!f.begun() && f.op && f.op->failed_flag.load()) {
    release_send(f);  // nobody waits for it any more
    return true;
  }
  if (f.op) frames_by_link_thread_.fetch_add(1, std::memory_order_relaxed);
  if (f.op && f.begun())
    frames_finished_for_caller_.fetch_add(1, std::memory_order_relaxed);
  if (!f.begun() && f.op && ring_ && ring_->carries(f.header.payload_bytes)) {
    return write_through_ring(fd, f, error);
  }
  if (f.written < static_cast<int64_t>(sizeof(f.header))) {
    const char* p = reinterpret_cast<const char*>(&f.header) + f.written;
    size_t n = sizeof(f.header) - static_cast<size_t>(f.written);
    if (!write_all(fd, p, n, f.stall_s, nullptr, error)) {
      release_send(f);
      return false;
    }
  }
  if (f.header.kind == kShmData) {  // its payload is in the ring
    release_send(f);
    return true;
  }
  const int64_t payload_done =
      std::max<int64_t>(0, f.written - static_cast<int64_t>(sizeof(f.header)));
  const char* data = (f.op ? f.data : f.message.data()) + payload_done;
  size_t left = static_cast<size_t>(f.header.payload_bytes - payload_done);
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
