// XLA FFI handlers for the CPU allreduce (the in-process transport): one
// asynchronous call, and a start/done pair for overlapping with compute.
#pragma once

#include "xla/ffi/api/ffi.h"

namespace jaxring {

XLA_FFI_DECLARE_HANDLER_SYMBOL(AllreduceCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(AllreduceStartCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(AllreduceDoneCpu);

// Waits (up to timeout_s) until no transport thread is completing an XLA
// future; returns whether none is. Completing one runs XLA's continuations
// on that thread: the rest of the program and the executable's own
// clean-up, some of it after the result is already visible to Python. A
// process that exits then tears the CPU client down under that thread, so
// jaxring calls this at interpreter exit, before JAX destroys its backends.
bool wait_for_completions(double timeout_s);

}  // namespace jaxring
