// The watchdog: one thread per process that follows every ring's work in
// flight and aborts a communicator whose work does not finish within its
// operation's timeout, counted from when the work starts on the ring's
// stream, or whose NCCL reports an asynchronous error
// (ncclCommGetAsyncError). Without it, a peer that dies mid-operation
// would leave this rank's NCCL kernels, and so XLA's stream, waiting
// forever.
//
// Aborting sets the communicator's abort flag first, so the abort check
// enqueued after the work (abort_check.h) stops the computation with an
// error; the reason goes to stderr, and every later call on the
// communicator fails at once with it (communicators.h).
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "checks.h"
#include "communicators.h"

namespace jaxring::cuda {

// Records, on c->stream, the event that marks the start of an operation's
// work on this ring (call with `device` current and c->mu held).
Status watch_start(Communicator* c, int device, cudaEvent_t* started);

// Enqueues the abort check and the end-of-work event on c->stream after
// the operation's work, and hands the pair to the watchdog. `what` names
// the work in messages.
Status watch_finish(Communicator* c, int device, cudaEvent_t started,
                    double timeout_s, std::string what);

// Returns an event from watch_start that will not be watched (the
// operation failed before watch_finish).
void watch_cancel(int device, cudaEvent_t started);

// Stops the thread and frees its events (at exit, before the communicators
// are destroyed).
void stop_watchdog();

// Operations being watched, for tests.
int watched_count();

}  // namespace jaxring::cuda
