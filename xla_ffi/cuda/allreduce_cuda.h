// The XLA FFI handler of the CUDA allreduce: the ring plan's chunked
// multi-ring allreduce, each ring on its own NCCL communicator and stream
// (algorithm "ring"), or NCCL's own allreduce per chunk on the same rings
// (algorithm "nccl", the built-in reference).
//
// The handler only enqueues: it forks each ring's stream from XLA's stream
// with an event, issues the ring's steps, and makes XLA's stream wait for
// every ring with events. It never waits for the GPU on the host.
#pragma once

#include "xla/ffi/api/ffi.h"

namespace jaxring::cuda {

XLA_FFI_DECLARE_HANDLER_SYMBOL(AllreduceCuda);

}  // namespace jaxring::cuda
