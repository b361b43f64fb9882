// XLA FFI handlers for the CPU allreduce (the in-process transport): one
// asynchronous call, and a start/done pair for overlapping with compute.
#pragma once

#include "xla/ffi/api/ffi.h"

namespace jaxring {

XLA_FFI_DECLARE_HANDLER_SYMBOL(AllreduceCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(AllreduceStartCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(AllreduceDoneCpu);

}  // namespace jaxring
