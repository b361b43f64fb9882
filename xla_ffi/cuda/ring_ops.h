// The CUDA allreduce as the FFI handlers issue it: the checked description
// of one call, and the issuing of its rings. The synchronous handler
// (allreduce_cuda.cc) and the split-phase start (split_phase_cuda.cc) differ
// only in where scratch comes from and in who waits for the rings.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <functional>
#include <vector>

#include "../algorithm.h"
#include "../reduce.h"
#include "../ring_attrs.h"
#include "checks.h"
#include "communicators.h"
#include "xla/ffi/api/ffi.h"

namespace jaxring::cuda {

// This process's index in a multi-process job (jax.process_index()), which
// the handlers look up with their device ordinal in the rank tables.
void set_process_index(int index);

// What one call does, checked and resolved from its attributes.
struct CudaOp {
  ElemType type;
  ReduceOp op;
  Algorithm algorithm;  // kRing or kNccl
  int world_size;
  // The plan's tiers, tightest first (topology attribute); empty: one flat
  // ring over the group.
  std::vector<int> dims;
  int rank;
  int group;
  int num_rings;
  int64_t chunk_bytes;
  double timeout_s;
  int64_t op_id;
};

// Checks a call's attributes (ring_attrs.h) and finds this device's rank
// and group: the row of (ring.rank_process, rank_device) that is this
// process and `device`.
Status describe(xla::ffi::DataType dtype, int device, const RingAttrs& ring,
                xla::ffi::Span<const int64_t> rank_device,
                xla::ffi::Span<const int64_t> nccl_ids, CudaOp* op);

struct RingIssue {
  // Sets (*out)[r] to `bytes` of scratch for each ring (called once, before
  // the fork). The memory must outlive the rings' work.
  std::function<Status(int64_t bytes, std::vector<void*>* out)> scratch;
  // Called after ring r's work is enqueued on c->stream, to record on it
  // what whoever consumes the result waits for.
  std::function<Status(int r, Communicator* c)> join;
  // When set, xla_stream waits on every ring's c->join once all rings are
  // issued (join must then record c->join); otherwise the consumer waits
  // later on whatever join recorded.
  bool xla_stream_waits = false;
};

// Issues the allreduce of `count` elements from `in` into `out` (which may
// alias) on the rings' streams, all forked from one point of xla_stream so
// that they run side by side: takes the rings' communicators (joining them
// on first use) and holds their locks while it enqueues, with `device`
// current. Never waits for the GPU. On a failure after the fork, aborts the
// rings and still makes xla_stream wait for the ones forked.
Status issue_allreduce(cudaStream_t xla_stream, int device, const CudaOp& op,
                       xla::ffi::Span<const int64_t> nccl_ids, const void* in,
                       void* out, int64_t count, const RingIssue& how);

}  // namespace jaxring::cuda
