// The split-phase allreduce on CUDA, for jaxring.overlap: a start that
// enqueues a bucket's allreduce on the ring streams and returns, and a done
// that makes XLA's stream wait for it.
//
// Start copies its operands, on XLA's stream, into one buffer that jaxring
// allocates (stream-ordered, cudaMallocAsync) and the rings reduce in
// place; the rings' scratch is jaxring's too. So no buffer the ring
// streams touch belongs to XLA, which can free or reuse the operands as
// soon as the start's copies have run. Done waits on the rings' events,
// copies the result out into its own results, and frees both buffers on
// XLA's stream after the copy. This mirrors the CPU backend's split phase,
// which also copies operands into transport-owned memory.
//
// A done finds its start by (device, op id): each start is queued there
// and the next done of that op on that device takes it, since one device
// runs the executions of a program in order.
#pragma once

#include "xla/ffi/api/ffi.h"

namespace jaxring::cuda {

XLA_FFI_DECLARE_HANDLER_SYMBOL(AllreduceStartCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(AllreduceDoneCuda);

// Starts whose done has not run yet, for tests.
int split_phase_pending_cuda();

}  // namespace jaxring::cuda
