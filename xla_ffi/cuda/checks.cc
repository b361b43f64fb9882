#include "checks.h"

#include <sstream>

namespace jaxring::cuda {

std::string cuda_failure(cudaError_t e, const char* call, const char* file,
                         int line) {
  std::ostringstream os;
  os << "jaxring CUDA backend: " << call << " failed with "
     << cudaGetErrorName(e) << " (" << cudaGetErrorString(e) << ") at " << file
     << ":" << line;
  return os.str();
}

std::string nccl_failure(ncclResult_t r, const char* call, const char* file,
                         int line) {
  std::ostringstream os;
  os << "jaxring CUDA backend: " << call << " failed with NCCL error " << r
     << " (" << ncclGetErrorString(r) << ")";
  const char* last = ncclGetLastError(nullptr);
  if (last != nullptr && last[0] != '\0') os << ": " << last;
  os << " at " << file << ":" << line;
  return os.str();
}

}  // namespace jaxring::cuda
