#include "split_phase_cuda.h"

#include <cuda_runtime.h>

#include <cstdint>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "../ffi_common.h"
#include "checks.h"
#include "communicators.h"
#include "device_guard.h"
#include "ring_ops.h"

namespace ffi = xla::ffi;

namespace jaxring::cuda {

namespace {

struct Started {
  void* buffer = nullptr;          // the operands, reduced in place
  std::vector<void*> scratch;      // one chunk per ring (ring algorithm)
  std::vector<cudaEvent_t> joins;  // one per ring, recorded after its work
  int64_t bytes = 0;
};

std::mutex mu;
// Keyed by (run id, device, op id): a run that fails between a start and
// its done leaves its entry behind, and the next run's done must not take
// it. Those entries are not reclaimed: their run id cannot tell a dead run
// from one still executing on another thread, whose done would then find
// nothing. First in first out within a run (a start in a loop body).
std::map<std::tuple<int64_t, int, int64_t>, std::deque<Started>> started;
int pending = 0;

// Stream-ordered memory for the buckets comes from a pool of jaxring's own
// per device, which keeps what it holds across synchronizations (release
// threshold: never). The device's default pool gives memory back to the
// driver at every synchronization (threshold 0), so a training loop would
// map and unmap its buckets every step; and the default pool is shared with
// other libraries, whose settings jaxring leaves alone.
std::mutex pools_mu;
std::map<int, cudaMemPool_t> pools;

Status pool_for(int device, cudaMemPool_t* out) {
  std::lock_guard<std::mutex> lock(pools_mu);
  auto it = pools.find(device);
  if (it == pools.end()) {
    cudaMemPoolProps props = {};
    props.allocType = cudaMemAllocationTypePinned;
    props.location.type = cudaMemLocationTypeDevice;
    props.location.id = device;
    cudaMemPool_t pool = nullptr;
    JAXRING_CUDA_CHECK(cudaMemPoolCreate(&pool, &props));
    uint64_t keep_all = UINT64_MAX;
    JAXRING_CUDA_CHECK(cudaMemPoolSetAttribute(
        pool, cudaMemPoolAttrReleaseThreshold, &keep_all));
    it = pools.emplace(device, pool).first;
  }
  *out = it->second;
  return std::nullopt;
}

// Frees what a start allocated, ordered on `stream` (after what it already
// holds), and destroys its events once they have completed. `stream` must
// already wait on every event in s.joins (wait_for_rings).
void release(Started& s, cudaStream_t stream) {
  for (cudaEvent_t e : s.joins) cudaEventDestroy(e);
  if (s.buffer != nullptr) cudaFreeAsync(s.buffer, stream);
  for (void* p : s.scratch) {
    if (p != nullptr) cudaFreeAsync(p, stream);
  }
  // Unchecked on purpose; a failure must not stay as this thread's last
  // error for a later, unrelated check.
  (void)cudaGetLastError();
}

// Makes `stream` wait on every ring of the start (`guard` makes the
// device current).
Status wait_for_rings(const Started& s, cudaStream_t stream,
                      const DeviceGuard& guard) {
  JAXRING_CUDA_CHECK(guard.status());
  for (cudaEvent_t e : s.joins)
    JAXRING_CUDA_CHECK(cudaStreamWaitEvent(stream, e, 0));
  return std::nullopt;
}

// After wait_for_rings failed: `stream` is not ordered after every ring, so
// freeing the start's buffers on it could hand memory a ring still writes
// to another allocation. They are leaked instead (the failure means the
// context is likely unusable anyway); the events are destroyed (CUDA
// releases them once their work completes, without blocking the host).
void abandon(Started& s) {
  for (cudaEvent_t e : s.joins) cudaEventDestroy(e);
  (void)cudaGetLastError();
}

// Frees the start's buffers once `stream` waits for its rings, or leaks
// them when it cannot be made to (abandon). Returns the wait's failure.
Status wait_and_release(Started& s, int device, cudaStream_t stream) {
  DeviceGuard guard(device);
  Status e = wait_for_rings(s, stream, guard);
  if (e) {
    abandon(s);
  } else {
    release(s, stream);
  }
  return e;
}

Status start(cudaStream_t stream, int device, ffi::RemainingArgs args,
             int64_t num_deps, const CudaOp& op_in,
             ffi::Span<const int64_t> nccl_ids, Started* s) {
  CudaOp op = op_in;
  DeviceGuard guard(device);
  JAXRING_CUDA_CHECK(guard.status());
  // The operands (after the ordering dependencies), back to back.
  std::vector<std::pair<const void*, int64_t>> parts;
  for (size_t i = static_cast<size_t>(num_deps); i < args.size(); ++i) {
    auto buf = args.get<ffi::AnyBuffer>(i);
    if (!buf.has_value())
      return "jaxring allreduce start: an operand is not a buffer";
    parts.emplace_back(buf->untyped_data(),
                       static_cast<int64_t>(buf->size_bytes()));
    s->bytes += static_cast<int64_t>(buf->size_bytes());
  }
  const int64_t esize = elem_bytes(op.type);
  if (s->bytes == 0) return std::nullopt;
  cudaMemPool_t pool = nullptr;
  JAXRING_RETURN_IF_FAILED(pool_for(device, &pool));
  JAXRING_CUDA_CHECK(
      cudaMallocFromPoolAsync(&s->buffer, s->bytes, pool, stream));
  int64_t offset = 0;
  for (const auto& [ptr, n] : parts) {
    JAXRING_CUDA_CHECK(cudaMemcpyAsync(static_cast<char*>(s->buffer) + offset,
                                       ptr, n, cudaMemcpyDeviceToDevice,
                                       stream));
    offset += n;
  }
  RingIssue how;
  how.scratch = [&](int64_t bytes, std::vector<void*>* out) -> Status {
    for (void*& p : *out) {
      JAXRING_CUDA_CHECK(cudaMallocFromPoolAsync(&p, bytes, pool, stream));
      s->scratch.push_back(p);
    }
    return std::nullopt;
  };
  how.join = [&](int, Communicator* c) -> Status {
    cudaEvent_t e;
    JAXRING_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    s->joins.push_back(e);
    JAXRING_CUDA_CHECK(cudaEventRecord(e, c->stream));
    return std::nullopt;
  };
  return issue_allreduce(stream, device, op, nccl_ids, s->buffer, s->buffer,
                         s->bytes / esize, how);
}

ffi::Error AllreduceStartCudaImpl(cudaStream_t stream, int32_t device,
                                  ffi::RunId run_id, ffi::RemainingArgs args,
                                  ffi::Result<ffi::Buffer<ffi::S32>> handle,
                                  CudaStartAttrs attrs) {
  const int64_t num_deps = attrs.num_deps;
  const int64_t op_id = attrs.ring.op_id;
  if (num_deps < 0 || static_cast<size_t>(num_deps) >= args.size()) {
    return ffi::Error::InvalidArgument(
        "jaxring allreduce start: no operands after the dependencies");
  }
  auto first = args.get<ffi::AnyBuffer>(static_cast<size_t>(num_deps));
  if (!first.has_value()) {
    return ffi::Error::InvalidArgument("jaxring allreduce start: bad operand");
  }
  for (size_t i = static_cast<size_t>(num_deps); i < args.size(); ++i) {
    auto b = args.get<ffi::AnyBuffer>(i);
    if (!b.has_value() || b->element_type() != first->element_type()) {
      return ffi::Error::InvalidArgument(
          "jaxring allreduce start: operands mix dtypes");
    }
  }
  CudaOp op;
  if (Status e = describe(first->element_type(), device, attrs.ring,
                          attrs.rank_device, attrs.nccl_ids, &op)) {
    return ffi::Error::InvalidArgument(*e);
  }
  Started s;
  // On a failure, issue_allreduce has already made XLA's stream wait for
  // the rings it forked; after the memset, the rings have only recorded
  // their joins. Either way the buffers are freed behind every join.
  if (Status e =
          start(stream, device, args, num_deps, op, attrs.nccl_ids, &s)) {
    wait_and_release(s, device, stream);
    return failure_error(*e);
  }
  // The handle's value is not used: done finds the start by (run, device,
  // op).
  if (cudaMemsetAsync(handle->untyped_data(), 0, sizeof(int32_t), stream) !=
      cudaSuccess) {
    wait_and_release(s, device, stream);
    return ffi::Error::Internal(
        "jaxring allreduce start: cudaMemsetAsync failed");
  }
  std::lock_guard<std::mutex> lock(mu);
  started[{run_id.run_id, device, op_id}].push_back(std::move(s));
  ++pending;
  return ffi::Error::Success();
}

// Copies the reduced operands into the results, on `stream`, which already
// waits for the rings (with the device current).
Status copy_out(cudaStream_t stream, const Started& s,
                ffi::RemainingRets results) {
  int64_t offset = 0;
  for (size_t i = 0; i < results.size(); ++i) {
    auto out = results.get<ffi::AnyBuffer>(i);
    if (!out.has_value())
      return "jaxring allreduce done: a result is not a buffer";
    const int64_t n = static_cast<int64_t>((*out)->size_bytes());
    if (offset + n > s.bytes) {
      return "jaxring allreduce done: the results are larger than the operands";
    }
    if (n > 0) {
      JAXRING_CUDA_CHECK(cudaMemcpyAsync((*out)->untyped_data(),
                                         static_cast<char*>(s.buffer) + offset,
                                         n, cudaMemcpyDeviceToDevice, stream));
    }
    offset += n;
  }
  if (offset != s.bytes) {
    return "jaxring allreduce done: the results do not match the operands";
  }
  return std::nullopt;
}

ffi::Error AllreduceDoneCudaImpl(cudaStream_t stream, int32_t device,
                                 ffi::RunId run_id,
                                 ffi::Buffer<ffi::S32> handle,
                                 ffi::RemainingArgs deps,
                                 ffi::RemainingRets results, int64_t op_id) {
  (void)handle;
  (void)deps;  // ordering only
  Started s;
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = started.find({run_id.run_id, device, op_id});
    if (it == started.end() || it->second.empty()) {
      std::ostringstream os;
      os << "jaxring allreduce done: no matching start on device " << device
         << " for op " << op_id << " in run " << run_id.run_id;
      return ffi::Error::Internal(os.str());
    }
    s = std::move(it->second.front());
    it->second.pop_front();
    if (it->second.empty()) started.erase(it);
    --pending;
  }
  DeviceGuard guard(device);
  if (Status e = wait_for_rings(s, stream, guard)) {
    // Not waited on every ring: leak the buffers rather than free them.
    abandon(s);
    return failure_error(*e);
  }
  Status e = copy_out(stream, s, results);
  release(s, stream);  // after the copies, on the same stream
  if (e) return failure_error(*e);
  return ffi::Error::Success();
}

}  // namespace

int split_phase_pending_cuda() {
  std::lock_guard<std::mutex> lock(mu);
  return pending;
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    AllreduceStartCuda, AllreduceStartCudaImpl,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()
        .Ctx<ffi::DeviceOrdinal>()
        .Ctx<ffi::RunId>()             // one id per execution
        .RemainingArgs()               // num_deps dependencies, then operands
        .Ret<ffi::Buffer<ffi::S32>>()  // handle for done (its value unused)
        .Attrs<CudaStartAttrs>());     // ring_attrs.h

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    AllreduceDoneCuda, AllreduceDoneCudaImpl,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()
        .Ctx<ffi::DeviceOrdinal>()
        .Ctx<ffi::RunId>()             // matches the start's
        .Arg<ffi::Buffer<ffi::S32>>()  // handle from start
        .RemainingArgs()               // ordering dependencies
        .RemainingRets()               // the results, shaped like the operands
        .Attr<int64_t>("op_id"));

}  // namespace jaxring::cuda
