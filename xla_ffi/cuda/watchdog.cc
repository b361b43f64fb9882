#include "watchdog.h"

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <list>
#include <map>
#include <mutex>
#include <sstream>
#include <thread>
#include <utility>
#include <vector>

#include "abort_check.h"
#include "device_guard.h"

namespace jaxring::cuda {

namespace {

using Clock = std::chrono::steady_clock;

struct Watch {
  Communicator* comm;
  int device;
  cudaEvent_t started;
  cudaEvent_t finished;
  double timeout_s;
  std::string what;
  bool running = false;          // `started` has completed
  Clock::time_point deadline{};  // set once running
};

std::mutex mu;
std::condition_variable wake;
std::list<Watch> watches;
std::thread thread;
bool stopping = false;
int open_watches = 0;  // handed over and not over yet
// Events ready for reuse, per device (an event belongs to its device).
std::map<int, std::vector<cudaEvent_t>> free_events;

Status take_event(int device, cudaEvent_t* out) {
  {
    std::lock_guard<std::mutex> lock(mu);
    auto& pool = free_events[device];
    if (!pool.empty()) {
      *out = pool.back();
      pool.pop_back();
      return std::nullopt;
    }
  }
  DeviceGuard guard(device);
  JAXRING_CUDA_CHECK(guard.status());
  JAXRING_CUDA_CHECK(cudaEventCreateWithFlags(out, cudaEventDisableTiming));
  return std::nullopt;
}

void give_back_locked(int device, cudaEvent_t e) {
  free_events[device].push_back(e);
}

void abort_for(Watch& w, const std::string& why) {
  std::ostringstream os;
  os << "jaxring CUDA backend: " << w.what << " " << why
     << "; the communicator was aborted";
  std::fprintf(stderr, "%s\n", os.str().c_str());
  abort_communicator(w.comm, os.str());
}

// True when the watch is over: its work finished, or its communicator was
// aborted (the abort check then stops the computation).
bool poll(Watch& w) {
  // This is the watchdog's own thread: with no device current, the event
  // queries would create GPU 0's primary context. Not a DeviceGuard, whose
  // restoring this thread's default device 0 would create it all the same.
  if (cudaSetDevice(w.device) != cudaSuccess) {
    cudaGetLastError();
    return true;  // as for a failed query below
  }
  const cudaError_t f = cudaEventQuery(w.finished);
  if (f == cudaSuccess) return true;
  if (f != cudaErrorNotReady) {
    // The context already failed (a sticky error); XLA reports it.
    cudaGetLastError();
    return true;
  }
  if (!w.running && cudaEventQuery(w.started) == cudaSuccess) {
    w.running = true;
    w.deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                    std::chrono::duration<double>(w.timeout_s));
  }
  // The handler holds the lock while it enqueues; try again next round
  // rather than wait behind it.
  std::unique_lock<std::mutex> lock(w.comm->mu, std::try_to_lock);
  if (!lock.owns_lock()) return false;
  if (w.comm->aborted) return true;
  ncclResult_t state = ncclSuccess;
  if (ncclCommGetAsyncError(w.comm->comm, &state) == ncclSuccess &&
      state != ncclSuccess && state != ncclInProgress) {
    abort_for(
        w, std::string("failed with NCCL error ") + ncclGetErrorString(state));
    return true;
  }
  if (w.running && Clock::now() > w.deadline) {
    std::ostringstream os;
    os << "timed out after " << w.timeout_s
       << " s: a peer did not arrive or stopped";
    abort_for(w, os.str());
    return true;
  }
  return false;
}

void loop() {
  std::unique_lock<std::mutex> lock(mu);
  while (!stopping) {
    if (watches.empty()) {
      wake.wait(lock);
      continue;
    }
    std::list<Watch> batch;
    batch.swap(watches);
    lock.unlock();
    std::list<Watch> open;
    std::vector<Watch> over;
    for (Watch& w : batch) {
      if (poll(w)) {
        over.push_back(std::move(w));
      } else {
        open.push_back(std::move(w));
      }
    }
    lock.lock();
    open_watches -= static_cast<int>(over.size());
    for (Watch& w : over) {
      give_back_locked(w.device, w.started);
      give_back_locked(w.device, w.finished);
    }
    watches.splice(watches.begin(), open);  // older watches first
    wake.wait_for(lock, std::chrono::milliseconds(1));
  }
}

}  // namespace

Status watch_start(Communicator* c, int device, cudaEvent_t* started) {
  JAXRING_RETURN_IF_FAILED(take_event(device, started));
  const cudaError_t e = cudaEventRecord(*started, c->stream);
  if (e != cudaSuccess) {
    watch_cancel(device, *started);
    return cuda_failure(e, "cudaEventRecord of the start event", __FILE__,
                        __LINE__);
  }
  return std::nullopt;
}

Status watch_finish(Communicator* c, int device, cudaEvent_t started,
                    double timeout_s, std::string what) {
  cudaEvent_t finished = nullptr;
  Status s = take_event(device, &finished);
  if (!s) {
    cudaError_t e = launch_abort_check(c->abort_flag_device, c->stream);
    if (e == cudaSuccess) e = cudaEventRecord(finished, c->stream);
    if (e != cudaSuccess) {
      s = cuda_failure(e, "enqueueing the abort check and its event", __FILE__,
                       __LINE__);
      watch_cancel(device, finished);
    }
  }
  if (s) {
    watch_cancel(device, started);
    return s;
  }
  std::lock_guard<std::mutex> lock(mu);
  if (!thread.joinable() && !stopping) thread = std::thread(loop);
  Watch w{c, device, started, finished, timeout_s, std::move(what)};
  watches.push_back(std::move(w));
  ++open_watches;
  wake.notify_one();
  return std::nullopt;
}

void watch_cancel(int device, cudaEvent_t started) {
  std::lock_guard<std::mutex> lock(mu);
  give_back_locked(device, started);
}

void stop_watchdog() {
  {
    std::lock_guard<std::mutex> lock(mu);
    stopping = true;
    wake.notify_all();
  }
  if (thread.joinable()) thread.join();
  std::lock_guard<std::mutex> lock(mu);
  // Watches still open hold two events each: into the pools, destroyed
  // below (an event whose work is still pending is freed once it ends).
  for (Watch& w : watches) {
    give_back_locked(w.device, w.started);
    give_back_locked(w.device, w.finished);
  }
  watches.clear();
  open_watches = 0;
  for (auto& [device, pool] : free_events) {
    DeviceGuard guard(device);
    for (cudaEvent_t e : pool) cudaEventDestroy(e);
  }
  free_events.clear();
}

int watched_count() {
  std::lock_guard<std::mutex> lock(mu);
  return open_watches;
}

}  // namespace jaxring::cuda
