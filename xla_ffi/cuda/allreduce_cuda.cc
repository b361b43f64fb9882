#include "allreduce_cuda.h"

#include <cuda_runtime.h>

#include <optional>
#include <string>
#include <vector>

#include "../ffi_common.h"
#include "checks.h"
#include "communicators.h"
#include "ring_ops.h"

namespace ffi = xla::ffi;

namespace jaxring::cuda {

namespace {

constexpr size_t kScratchAlignment = 16;

ffi::Error AllreduceCudaImpl(cudaStream_t stream, int32_t device,
                             ffi::ScratchAllocator scratch, ffi::AnyBuffer x,
                             ffi::Result<ffi::AnyBuffer> out, CudaAttrs attrs) {
  if (out->element_type() != x.element_type() ||
      out->element_count() != x.element_count()) {
    return ffi::Error::InvalidArgument(
        "jaxring allreduce: the result must have the operand's type and size");
  }
  CudaOp op;
  if (Status s = describe(x.element_type(), device, attrs.ring,
                          attrs.rank_device, attrs.nccl_ids, &op)) {
    return ffi::Error::InvalidArgument(*s);
  }
  RingIssue how;
  // XLA's scratch memory is ordered on its stream, which waits for every
  // ring (below), so the rings' use of it ends before XLA reuses it.
  // XLA's FFI refuses alignments above 16 bytes ("Unsupported
  // alignment"); its allocator hands out blocks aligned far more coarsely,
  // and the reduce kernel's vector loads need 16.
  how.scratch = [&scratch](int64_t bytes, std::vector<void*>* out) -> Status {
    for (void*& p : *out) {
      std::optional<void*> buf = scratch.Allocate(bytes, kScratchAlignment);
      if (!buf) {
        return "jaxring CUDA backend: XLA gave no scratch memory for a chunk "
               "(" +
               std::to_string(bytes) + " bytes)";
      }
      p = *buf;
    }
    return std::nullopt;
  };
  // Each ring records its join; issue_allreduce makes XLA's stream wait on
  // every ring's join once the last ring is issued.
  how.join = [](int, Communicator* c) -> Status {
    JAXRING_CUDA_CHECK(cudaEventRecord(c->join, c->stream));
    return std::nullopt;
  };
  how.xla_stream_waits = true;
  if (Status s = issue_allreduce(
          stream, device, op, attrs.nccl_ids, x.untyped_data(),
          out->untyped_data(), static_cast<int64_t>(x.element_count()), how)) {
    return failure_error(*s);
  }
  return ffi::Error::Success();
}

}  // namespace

// Not marked command-buffer compatible: the handler picks communicators and
// records events at run time, which a captured CUDA graph would replay
// without.
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    AllreduceCuda, AllreduceCudaImpl,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()  // XLA's compute stream
        .Ctx<ffi::DeviceOrdinal>()                 // this device
        .Ctx<ffi::ScratchAllocator>()              // per-ring chunk buffers
        .Arg<ffi::AnyBuffer>()                     // x
        .Ret<ffi::AnyBuffer>()                     // the reduced result
        .Attrs<CudaAttrs>());                      // ring_attrs.h

}  // namespace jaxring::cuda
