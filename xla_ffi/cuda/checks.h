// CUDA and NCCL failures as messages that name the call, file and line.
//
// Every function of the CUDA backend that can fail returns
// std::optional<std::string> (nullopt: success), like the CPU backend's
// helpers; the FFI handlers turn a message into an ffi::Error.
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>

#include <optional>
#include <string>

namespace jaxring::cuda {

using Status = std::optional<std::string>;

std::string cuda_failure(cudaError_t e, const char* call, const char* file,
                         int line);
std::string nccl_failure(ncclResult_t r, const char* call, const char* file,
                         int line);

}  // namespace jaxring::cuda

#define JAXRING_CUDA_CHECK(call)                                        \
  do {                                                                  \
    const cudaError_t jaxring_e_ = (call);                              \
    if (jaxring_e_ != cudaSuccess) {                                    \
      return ::jaxring::cuda::cuda_failure(jaxring_e_, #call, __FILE__, \
                                           __LINE__);                   \
    }                                                                   \
  } while (0)

// ncclInProgress is not a failure on a nonblocking communicator: the caller
// waits for the communicator to become ready (communicators.h). _AS names
// the call in the message when the result was taken earlier.
#define JAXRING_NCCL_CHECK_AS(result, name)                            \
  do {                                                                 \
    const ncclResult_t jaxring_r_ = (result);                          \
    if (jaxring_r_ != ncclSuccess && jaxring_r_ != ncclInProgress) {   \
      return ::jaxring::cuda::nccl_failure(jaxring_r_, name, __FILE__, \
                                           __LINE__);                  \
    }                                                                  \
  } while (0)
#define JAXRING_NCCL_CHECK(call) JAXRING_NCCL_CHECK_AS(call, #call)

#define JAXRING_RETURN_IF_FAILED(expr)           \
  do {                                           \
    ::jaxring::cuda::Status jaxring_s_ = (expr); \
    if (jaxring_s_) return jaxring_s_;           \
  } while (0)
