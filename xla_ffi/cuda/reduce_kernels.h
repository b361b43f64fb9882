// dst[i] = dst[i] (op) src[i] on a CUDA stream: the reduction of every
// reduce-scatter hop of the ring, with the same rules as the CPU backend
// (reduce_ops.h; 16-bit floats combine in float32 and round once per hop).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "../reduce.h"

namespace jaxring::cuda {

// Enqueues the reduction of n elements; returns the launch's error.
cudaError_t launch_reduce(ElemType type, ReduceOp op, void* dst,
                          const void* src, int64_t n, cudaStream_t stream);

}  // namespace jaxring::cuda
