// A one-thread kernel that fails if its communicator was aborted.
//
// A peer that dies mid-operation leaves the NCCL kernels of this rank
// waiting forever. The watchdog (watchdog.h) then aborts the communicator,
// which ends those kernels, but XLA's stream would carry on with a result
// that was never reduced. Each ring therefore runs this check after its
// work and before the join: when the abort flag is set it stops the kernel
// with a device-side trap, which makes the CUDA context report an error,
// so the computation raises in Python instead of returning wrong values.
// The context is unusable afterwards; a job that lost a peer restarts.
#pragma once

#include <cuda_runtime.h>

namespace jaxring::cuda {

cudaError_t launch_abort_check(const int* abort_flag, cudaStream_t stream);

}  // namespace jaxring::cuda
