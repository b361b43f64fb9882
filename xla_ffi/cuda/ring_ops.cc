#include "ring_ops.h"

#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <mutex>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "../ffi_common.h"
#include "../stream_schedule.h"
#include "../tiered_plan.h"
#include "device_guard.h"
#include "reduce_kernels.h"
#include "watchdog.h"

namespace ffi = xla::ffi;

namespace jaxring::cuda {

namespace {

std::atomic<int> process_index{0};

std::optional<ncclDataType_t> nccl_type(ElemType t) {
  switch (t) {
    case ElemType::kF16: return ncclFloat16;
    case ElemType::kBF16: return ncclBfloat16;
    case ElemType::kF32: return ncclFloat32;
    case ElemType::kF64: return ncclFloat64;
    case ElemType::kS8: return ncclInt8;
    case ElemType::kU8: return ncclUint8;
    case ElemType::kS32: return ncclInt32;
    case ElemType::kU32: return ncclUint32;
    case ElemType::kS64: return ncclInt64;
    case ElemType::kU64: return ncclUint64;
    case ElemType::kS16:
    case ElemType::kU16: return std::nullopt;
  }
  return std::nullopt;
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return ncclSum;
    case ReduceOp::kProd: return ncclProd;
    case ReduceOp::kMin: return ncclMin;
    case ReduceOp::kMax: return ncclMax;
  }
  return ncclSum;
}

// Finds this device's (group, rank): the one rank whose process is this
// one and whose device ordinal is `device`, world_size ranks per group.
Status locate(ffi::Span<const int64_t> rank_process,
              ffi::Span<const int64_t> rank_device, int64_t world_size,
              int device, int* group, int* rank) {
  const int me = process_index.load();
  const int64_t rows = static_cast<int64_t>(rank_process.size());
  int found = 0;
  for (int64_t i = 0; i < rows; ++i) {
    if (rank_process[i] == me && rank_device[i] == device) {
      *group = static_cast<int>(i / world_size);
      *rank = static_cast<int>(i % world_size);
      ++found;
    }
  }
  if (found == 1) return std::nullopt;
  std::ostringstream os;
  os << "jaxring CUDA backend: device " << device << " of process " << me
     << (found == 0 ? " is not among" : " appears more than once in")
     << " this allreduce's devices";
  return os.str();
}

}  // namespace

Status describe(ffi::DataType dtype, int device, const RingAttrs& a,
                ffi::Span<const int64_t> rank_device,
                ffi::Span<const int64_t> nccl_ids, CudaOp* op) {
  const int64_t world_size = a.world_size;
  const int64_t num_rings = a.num_rings;
  if (auto error = check_allreduce_attrs(dtype, a.reduce_op, world_size,
                                         num_rings, a.chunk_bytes, a.timeout_s,
                                         &op->type, &op->op)) {
    return error;
  }
  if (!algorithm_from_int(a.algorithm, &op->algorithm)) {
    return "jaxring allreduce: unknown algorithm";
  }
  if (op->algorithm == Algorithm::kDirect ||
      op->algorithm == Algorithm::kExchange) {
    return std::string("jaxring allreduce: algorithm '") +
           algorithm_name(op->algorithm) + "' exists on the CPU backend only";
  }
  // Python refuses these at trace time with the way out; here they only
  // must not pass unnoticed.
  if (a.group_sizes.size() > 0 || a.link_bytes_per_s.size() > 0) {
    return "jaxring allreduce: the CUDA backend runs rings of one size, "
           "without emulated links";
  }
  if (auto error = check_topology(a.topology, world_size, &op->dims))
    return error;
  if (op->algorithm == Algorithm::kNccl && !op->dims.empty()) {
    return "jaxring allreduce: algorithm 'nccl' runs NCCL's own allreduce, "
           "which has no tiers";
  }
  if (a.rank_process.size() != rank_device.size() ||
      a.rank_process.size() % world_size != 0) {
    return "jaxring allreduce: the rank tables are not whole groups";
  }
  const int64_t groups = a.rank_process.size() / world_size;
  constexpr int64_t kIdWords = NCCL_UNIQUE_ID_BYTES / sizeof(int64_t);
  if (static_cast<int64_t>(nccl_ids.size()) != groups * num_rings * kIdWords) {
    return "jaxring allreduce: expected one NCCL unique id per group and ring";
  }
  op->world_size = static_cast<int>(world_size);
  op->num_rings = static_cast<int>(num_rings);
  op->chunk_bytes = a.chunk_bytes;
  op->timeout_s = a.timeout_s;
  op->op_id = a.op_id;
  if (op->algorithm == Algorithm::kNccl && !nccl_type(op->type)) {
    return std::string("jaxring allreduce: algorithm 'nccl' has no ") +
           elem_type_name(op->type) + " type; use algorithm 'ring'";
  }
  return locate(a.rank_process, rank_device, world_size, device, &op->group,
                &op->rank);
}

namespace {

UniqueIdBytes id_of(ffi::Span<const int64_t> nccl_ids, int group, int ring,
                    int num_rings) {
  constexpr int64_t kIdWords = NCCL_UNIQUE_ID_BYTES / sizeof(int64_t);
  UniqueIdBytes id;
  const int64_t* words =
      nccl_ids.begin() + (group * num_rings + ring) * kIdWords;
  std::memcpy(id.data(), words, NCCL_UNIQUE_ID_BYTES);
  return id;
}

char* at(void* base, int64_t elem, int64_t esize) {
  return static_cast<char*>(base) + elem * esize;
}

// Enqueues ring r's exchanges for this rank on c->stream, in the stream
// order every rank shares (stream_schedule.h): a reduce exchange receives
// into scratch and reduces into the output, a store receives straight into
// it. The exchanges of one ring follow each other on the ring's stream; the
// rings run side by side.
//
// Tiers need no communicators of their own: the ring's communicator spans
// the whole group, and NCCL's point-to-point calls reach any rank of it,
// choosing the transport per pair of ranks (NVLink or shared memory inside
// a host, the network between hosts). A phase of the tiered plan is then
// its exchanges with that phase's neighbours, whose ranks the plan gives
// in the group's numbering, which is the communicator's.
Status enqueue_ring(const CudaOp& op, const TieredPlan& plan, int r,
                    Communicator* c, void* out, void* scratch) {
  const int64_t esize = plan.elem_bytes();
  for (const StreamExchange& x : stream_exchanges(plan, r, op.rank)) {
    void* recv_into = x.reduce ? scratch : at(out, x.recv.offset, esize);
    // The group is always closed, also when a call in it fails, so that
    // this thread's next NCCL call is not left inside it.
    JAXRING_NCCL_CHECK(ncclGroupStart());
    ncclResult_t result = ncclSuccess;
    if (x.send.count > 0) {
      result = ncclSend(at(out, x.send.offset, esize), x.send.count * esize,
                        ncclUint8, x.to, c->comm, c->stream);
    }
    if (x.recv.count > 0 &&
        (result == ncclSuccess || result == ncclInProgress)) {
      result = ncclRecv(recv_into, x.recv.count * esize, ncclUint8, x.from,
                        c->comm, c->stream);
    }
    const ncclResult_t end = ncclGroupEnd();
    JAXRING_NCCL_CHECK_AS(result, "ncclSend/ncclRecv of a ring step");
    JAXRING_NCCL_CHECK_AS(end, "ncclGroupEnd of a ring step");
    JAXRING_RETURN_IF_FAILED(
        wait_ready(c, op.timeout_s, "enqueueing a ring step"));
    if (x.reduce && x.recv.count > 0) {
      JAXRING_CUDA_CHECK(launch_reduce(op.type, op.op,
                                       at(out, x.recv.offset, esize), scratch,
                                       x.recv.count, c->stream));
    }
  }
  return std::nullopt;
}

// NCCL's allreduce over ring r's part, in one call: NCCL pipelines the
// buffer itself, and wants it whole to choose its protocol and channels.
// (Python gives this algorithm one ring, so the part is the buffer.)
Status enqueue_nccl(const CudaOp& op, const TieredPlan& plan, int r,
                    Communicator* c, const void* in, void* out) {
  const int64_t esize = plan.elem_bytes();
  const Span part = ring_part(plan, r);
  if (part.count > 0) {
    JAXRING_NCCL_CHECK_AS(
        ncclAllReduce(at(const_cast<void*>(in), part.offset, esize),
                      at(out, part.offset, esize), part.count,
                      *nccl_type(op.type), nccl_op(op.op), c->comm, c->stream),
        "ncclAllReduce");
  }
  return wait_ready(c, op.timeout_s, "enqueueing NCCL's allreduce");
}

// Ring r's share of the operation on c->stream, by the chosen algorithm.
Status enqueue_work(const CudaOp& op, const TieredPlan& plan, int r,
                    Communicator* c, void* scratch, const void* in, void* out) {
  if (op.algorithm == Algorithm::kNccl) {
    return enqueue_nccl(op, plan, r, c, in, out);
  }
  const int64_t esize = plan.elem_bytes();
  const Span part = ring_part(plan, r);
  if (out != in && part.count > 0) {
    JAXRING_CUDA_CHECK(cudaMemcpyAsync(
        at(out, part.offset, esize),
        at(const_cast<void*>(in), part.offset, esize), part.count * esize,
        cudaMemcpyDeviceToDevice, c->stream));
  }
  return enqueue_ring(op, plan, r, c, out, scratch);
}

// After a failure with rings already forked: their streams may still run
// the copy, reduce or NCCL kernels enqueued so far, and their operation
// sequence no longer matches the peers'. Every ring of the operation is
// aborted, and XLA's stream still waits for the forked ones, so that XLA
// does not free or reuse buffers they touch.
void fail_rings(cudaStream_t xla_stream,
                const std::vector<Communicator*>& comms, int forked,
                const std::string& why) {
  for (size_t r = 0; r < comms.size(); ++r) {
    Communicator* c = comms[r];
    abort_communicator(c, why);
    if (static_cast<int>(r) < forked) {
      cudaEventRecord(c->join, c->stream);
      cudaStreamWaitEvent(xla_stream, c->join, 0);
    }
  }
  // The calls above are best effort; a failure of theirs must not stay
  // behind as this thread's last error for a later, unrelated check.
  (void)cudaGetLastError();
}

}  // namespace

Status issue_allreduce(cudaStream_t xla_stream, int device, const CudaOp& op,
                       ffi::Span<const int64_t> nccl_ids, const void* in,
                       void* out, int64_t count, const RingIssue& how) {
  const int64_t esize = elem_bytes(op.type);
  // The ring streams, kernels and events belong to `device`; XLA's thread
  // may have another device current.
  DeviceGuard guard(device);
  JAXRING_CUDA_CHECK(guard.status());
  // A world of one still goes through its communicators, streams and
  // events (the ring then only copies), so one GPU exercises every part.
  if (count == 0) return std::nullopt;
  // The flat ring is the plan of one tier.
  std::optional<TieredPlan> plan;
  try {
    plan.emplace(op.dims.empty() ? std::vector<int>{op.world_size} : op.dims,
                 op.num_rings, count, esize, op.chunk_bytes);
  } catch (const std::invalid_argument& e) {
    return std::string("jaxring allreduce: ") + e.what();
  }
  std::vector<Communicator*> comms(op.num_rings);
  for (int r = 0; r < op.num_rings; ++r) {
    JAXRING_RETURN_IF_FAILED(communicator_for(
        id_of(nccl_ids, op.group, r, op.num_rings), op.world_size, op.rank,
        device, op.timeout_s, &comms[r]));
  }
  // Each ring's communicator is distinct; taking their locks in ring order
  // keeps two concurrent calls from deadlocking. Every rank issues its rings
  // in that same host order, ring 0 first, which NCCL requires of
  // communicators used side by side (with NCCL_LAUNCH_ORDER_IMPLICIT from
  // 2.26, set by module_cuda.cc).
  std::vector<std::unique_lock<std::mutex>> locks;
  for (Communicator* c : comms) {
    locks.emplace_back(c->mu);
    if (c->aborted) return aborted_error(c);
  }
  // Every ring's scratch before the first fork, so that running out of
  // memory fails before any work is enqueued. At least one element: a
  // rank of a tiny operation may have nothing to reduce, and a 0-byte
  // allocation is not promised to succeed.
  std::vector<void*> scratch_of(op.num_rings, nullptr);
  if (op.algorithm == Algorithm::kRing && op.world_size > 1) {
    JAXRING_RETURN_IF_FAILED(how.scratch(
        std::max<int64_t>(1, largest_reduce_receive(*plan, op.rank)) * esize,
        &scratch_of));
  }
  // One fork for every ring, recorded before any ring is issued: recording
  // it per ring after the previous ring's join would make each ring wait
  // for the one before. Ring 0's event serves, as its lock is held.
  cudaEvent_t fork = comms[0]->fork;
  JAXRING_CUDA_CHECK(cudaEventRecord(fork, xla_stream));
  for (int r = 0; r < op.num_rings; ++r) {
    Communicator* c = comms[r];
    // Built for every ring of every call (the watchdog keeps it for its
    // messages): plain concatenation, no stream.
    const std::string what =
        "allreduce op " + std::to_string(op.op_id) + ", ring " +
        std::to_string(r) + " (rank " + std::to_string(op.rank) + " of " +
        std::to_string(op.world_size) + ", group " + std::to_string(op.group) +
        ", device " + std::to_string(device) + ")";
    if (const cudaError_t e = cudaStreamWaitEvent(c->stream, fork, 0);
        e != cudaSuccess) {
      // Rings 0..r-1 already run: abort them and still join them.
      const std::string why = cuda_failure(e, "cudaStreamWaitEvent of the fork",
                                           __FILE__, __LINE__);
      fail_rings(xla_stream, comms, r, what + ": " + why);
      return why;
    }
    cudaEvent_t started = nullptr;
    Status s = watch_start(c, device, &started);
    if (!s) {
      s = enqueue_work(op, *plan, r, c, scratch_of[r], in, out);
      if (s) watch_cancel(device, started);
    }
    if (!s) s = watch_finish(c, device, started, op.timeout_s, what);
    if (s) {
      fail_rings(xla_stream, comms, r + 1, what + ": " + *s);
      return s;
    }
    if (Status j = how.join(r, c)) {
      fail_rings(xla_stream, comms, r + 1, what + ": " + *j);
      return j;
    }
  }
  // Only now, with every ring issued, does XLA's stream wait for them.
  if (how.xla_stream_waits) {
    for (Communicator* c : comms) {
      if (const cudaError_t e = cudaStreamWaitEvent(xla_stream, c->join, 0);
          e != cudaSuccess) {
        const std::string why = cuda_failure(e, "cudaStreamWaitEvent of a join",
                                             __FILE__, __LINE__);
        fail_rings(xla_stream, comms, op.num_rings,
                   "allreduce op " + std::to_string(op.op_id) + ": " + why);
        return why;
      }
    }
  }
  return std::nullopt;
}

void set_process_index(int index) { process_index.store(index); }

}  // namespace jaxring::cuda
