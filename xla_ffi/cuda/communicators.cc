#include "communicators.h"

#include <chrono>
#include <map>
#include <memory>
#include <sstream>
#include <thread>
#include <utility>

#include "../failure.h"
#include "device_guard.h"
#include "watchdog.h"

namespace jaxring::cuda {

namespace {

using Clock = std::chrono::steady_clock;

struct Key {
  UniqueIdBytes id;
  int device;
  bool operator<(const Key& o) const {
    return device != o.device ? device < o.device : id < o.id;
  }
};

std::mutex cache_mu;
std::map<Key, std::unique_ptr<Communicator>> cache;

Status create(const UniqueIdBytes& id, int world_size, int rank, int device,
              double timeout_s, Communicator* c) {
  DeviceGuard guard(device);
  JAXRING_CUDA_CHECK(guard.status());
  ncclUniqueId uid;
  std::copy(id.begin(), id.end(), uid.internal);
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  c->device = device;
  c->rank = rank;
  c->world_size = world_size;
  JAXRING_NCCL_CHECK(
      ncclCommInitRankConfig(&c->comm, world_size, uid, rank, &config));
  JAXRING_RETURN_IF_FAILED(
      wait_ready(c, timeout_s, "joining the communicator"));
  JAXRING_CUDA_CHECK(
      cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking));
  JAXRING_CUDA_CHECK(
      cudaEventCreateWithFlags(&c->fork, cudaEventDisableTiming));
  JAXRING_CUDA_CHECK(
      cudaEventCreateWithFlags(&c->join, cudaEventDisableTiming));
  // Host memory the device reads: set when the communicator is aborted, so
  // that work already enqueued behind it fails (watchdog.h).
  void* flag = nullptr;
  JAXRING_CUDA_CHECK(cudaHostAlloc(&flag, sizeof(int), cudaHostAllocMapped));
  c->abort_flag_host = static_cast<volatile int*>(flag);
  *c->abort_flag_host = 0;
  void* on_device = nullptr;
  JAXRING_CUDA_CHECK(cudaHostGetDevicePointer(&on_device, flag, 0));
  c->abort_flag_device = static_cast<const int*>(on_device);
  return std::nullopt;
}

}  // namespace

Status new_unique_id(UniqueIdBytes* out) {
  ncclUniqueId uid;
  JAXRING_NCCL_CHECK(ncclGetUniqueId(&uid));
  std::copy(uid.internal, uid.internal + NCCL_UNIQUE_ID_BYTES, out->begin());
  return std::nullopt;
}

void abort_communicator(Communicator* c, const std::string& why) {
  if (c->aborted) return;
  c->aborted = true;
  c->abort_reason = why;
  if (c->abort_flag_host != nullptr) *c->abort_flag_host = 1;
  if (c->comm != nullptr) ncclCommAbort(c->comm);
  c->comm = nullptr;
}

Status wait_ready(Communicator* c, double timeout_s, const char* what) {
  const auto deadline =
      Clock::now() + std::chrono::duration_cast<Clock::duration>(
                         std::chrono::duration<double>(timeout_s));
  for (;;) {
    ncclResult_t state = ncclSuccess;
    const ncclResult_t r = ncclCommGetAsyncError(c->comm, &state);
    if (r != ncclSuccess) state = r;
    if (state == ncclSuccess) return std::nullopt;
    std::ostringstream os;
    if (state != ncclInProgress) {
      // ncclGetLastError holds NCCL's own reason (e.g. "Duplicate GPU
      // detected"), which the error code alone does not say.
      const char* last = ncclGetLastError(c->comm);
      os << "jaxring CUDA backend: NCCL error " << state << " ("
         << ncclGetErrorString(state) << ") while " << what << " (rank "
         << c->rank << " of " << c->world_size << ", device " << c->device
         << "); the communicator was aborted";
      if (last != nullptr && last[0] != '\0') os << ". NCCL said: " << last;
      // A remote error is another rank's failure reaching this one.
      const std::string message =
          tagged(state == ncclRemoteError ? FailureKind::kPeerLost
                                          : FailureKind::kInternal,
                 -1, os.str());
      abort_communicator(c, message);
      return message;
    }
    if (Clock::now() > deadline) {
      os << "jaxring CUDA backend: timed out after " << timeout_s << " s "
         << what << " (rank " << c->rank << " of " << c->world_size
         << ", device " << c->device
         << "): a peer did not arrive or stopped; the communicator was aborted";
      const std::string message = tagged(FailureKind::kTimeout, -1, os.str());
      abort_communicator(c, message);
      return message;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
}

Status communicator_for(const UniqueIdBytes& id, int world_size, int rank,
                        int device, double timeout_s, Communicator** out) {
  Communicator* c = nullptr;
  {
    std::lock_guard<std::mutex> lock(cache_mu);
    auto& slot = cache[Key{id, device}];
    if (!slot) slot = std::make_unique<Communicator>();
    c = slot.get();
  }
  // Whoever takes c->mu first joins the communicator, outside the cache
  // lock, so the other devices of this process join theirs meanwhile; a
  // second caller on this device waits for the first and finds it ready.
  std::lock_guard<std::mutex> lock(c->mu);
  if (!c->ready && !c->aborted) {
    Status s = create(id, world_size, rank, device, timeout_s, c);
    if (s) {
      abort_communicator(c, *s);
      return s;
    }
    c->ready = true;
  }
  if (c->aborted) return aborted_error(c);
  if (c->rank != rank || c->world_size != world_size) {
    return "jaxring CUDA backend: one NCCL unique id used with two different "
           "ranks or world sizes on one device";
  }
  *out = c;
  return std::nullopt;
}

std::string aborted_error(const Communicator* c) {
  return "jaxring CUDA backend: this communicator was aborted earlier and "
         "cannot be used again (restart the job): " +
         c->abort_reason;
}

int destroy_communicators() {
  stop_watchdog();
  std::lock_guard<std::mutex> lock(cache_mu);
  int n = 0;
  for (auto& [key, c] : cache) {
    std::lock_guard<std::mutex> clock(c->mu);
    DeviceGuard guard(c->device);
    // Let the ring's work drain, for a few seconds at most: with a peer
    // gone it never would, and the watchdog is already stopped.
    if (c->stream != nullptr && !c->aborted) {
      const auto deadline = Clock::now() + std::chrono::seconds(5);
      cudaError_t q;
      while ((q = cudaStreamQuery(c->stream)) == cudaErrorNotReady &&
             Clock::now() < deadline) {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      if (q != cudaSuccess) {
        cudaGetLastError();
        abort_communicator(c.get(), "its work did not drain at exit");
      }
    }
    if (c->comm != nullptr && !c->aborted) {
      // Finalize flushes the communicator's work (nonblocking: it returns
      // ncclInProgress); if that does not finish in a few seconds (a peer is
      // gone), wait_ready aborts the communicator instead.
      const ncclResult_t r = ncclCommFinalize(c->comm);
      if ((r == ncclSuccess || r == ncclInProgress) &&
          !wait_ready(c.get(), 5.0, "finalizing at exit")) {
        ncclCommDestroy(c->comm);
      } else if (!c->aborted) {
        ncclCommAbort(c->comm);
      }
      c->comm = nullptr;
    }
    if (c->fork != nullptr) cudaEventDestroy(c->fork);
    if (c->join != nullptr) cudaEventDestroy(c->join);
    if (c->stream != nullptr) cudaStreamDestroy(c->stream);
    // An aborted communicator's stream was not drained: an abort check
    // kernel on it may still read the flag, so its pinned word is left
    // allocated rather than freed under that kernel.
    if (c->abort_flag_host != nullptr && !c->aborted) {
      cudaFreeHost(const_cast<int*>(c->abort_flag_host));
    }
    ++n;
  }
  cache.clear();
  return n;
}

int communicator_count() {
  std::lock_guard<std::mutex> lock(cache_mu);
  return static_cast<int>(cache.size());
}

}  // namespace jaxring::cuda
