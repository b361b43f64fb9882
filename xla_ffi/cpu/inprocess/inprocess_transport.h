// In-process transport: executes the flat ring (the tiered plan of one tier)
// among the virtual CPU devices of one process
//
// Why it looks the way it does:
//  * XLA CPU runs every device program on one shared thread pool. A handler
//    that blocks waiting for its peers holds a pool thread and, with enough
//    of them, wedges the pool. So the FFI handler only hands the work to
//    jaxring's own worker thread for its device and returns an ffi::Future.
//  * Independent allreduces may start in different orders on different
//    devices, so peers are matched by an operation identity (run id, op id,
//    group) and a worker never blocks on one operation: it advances every
//    operation it holds as far as its peers allow, then sleeps until a peer
//    makes progress. No order of arrival can deadlock it.
//  * A future's continuation runs on the thread that completes it, so each
//    device's future is completed by that device's own worker; one thread
//    completing everyone's futures would let one device's next blocking step
//    starve the others.
//  * Data moves by direct reads: the rank at ring position i reads its
//    neighbour's buffers for the chunk the plan says it receives (or, with
//    Algorithm::kDirect, every rank's input for its own segment, which it
//    writes into every rank's output). A rank's future completes only once
//    every rank of the operation has finished, so no buffer is released
//    while a peer may still read or write it.
//  * Under link emulation the workers move the data in whole pipelines
//    (one chunk of one ring through every step) and the ranks then wait for
//    a modelled clock (see run_emulated in inprocess_emulation.cc): a worker
//    per rank stepping the ring would wait for a core at every step.
//  * Every wait has a deadline; a missing peer becomes an error naming it.
#pragma once

#include <cstdint>

#include "cpu/operation.h"

namespace jaxring {

// Starts `rank`'s part of an allreduce. `in` and `out` must stay valid until
// `done` is called. timeout_s bounds the whole wait for peers.
void inprocess_allreduce(const OpKey& key, const OpDesc& desc, int rank,
                         int device, const void* in, void* out,
                         double timeout_s, Completion done);

// Operations currently held by the transport (for tests: must drop to 0).
int64_t inprocess_pending_ops();

}  // namespace jaxring
