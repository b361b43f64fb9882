#include "abort_check.h"

#include <cstdio>

namespace jaxring::cuda {

namespace {

__global__ void abort_check(const int* abort_flag) {
  if (*static_cast<const volatile int*>(abort_flag) != 0) {
    printf(
        "jaxring CUDA backend: this allreduce's NCCL communicator was "
        "aborted (a peer died or timed out; see the message above); "
        "stopping the computation\n");
    __trap();
  }
}

}  // namespace

cudaError_t launch_abort_check(const int* abort_flag, cudaStream_t stream) {
  // Clears an error left by an earlier, unrelated runtime call, which the
  // cudaGetLastError below would otherwise blame on this launch.
  (void)cudaGetLastError();
  abort_check<<<1, 1, 0, stream>>>(abort_flag);
  return cudaGetLastError();
}

}  // namespace jaxring::cuda
