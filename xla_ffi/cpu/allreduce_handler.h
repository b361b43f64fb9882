// XLA FFI handler for the CPU allreduce (the in-process transport).
#pragma once

#include "xla/ffi/api/ffi.h"

namespace jaxring {

XLA_FFI_DECLARE_HANDLER_SYMBOL(AllreduceCpu);

}  // namespace jaxring
