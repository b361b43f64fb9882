// Gang start: the virtual CPU devices of one process wait for each other at
// the start of a split-phase allreduce.
//
// Why: the virtual devices share the machine's cores, and nothing keeps
// their programs in step. A device that runs ahead into the rest of its
// backward pass takes the cores that the devices behind it need to reach the
// bucket, and the ring cannot move before its last rank has joined, so
// running ahead only delays the transfer. On real accelerators each device
// computes at its own speed and they reach a bucket together. This wait gives
// the virtual devices that shape: a device that arrives early sleeps (no CPU)
// until the last one arrives, and the cores go to the ones behind.
//
// Only one operation gathers at a time. A device program may run independent
// starts in any order, so two devices could otherwise sit in different
// starts, each waiting for the other. A rank that reaches another
// operation's start while one gathers counts its arrival and goes on without
// waiting. The ranks that wait have already computed everything the
// gathering start depends on, and the ranks that do not wait are blocked
// nowhere, so the ones still missing can always arrive.
//
// The wait is bounded and never fails: after max_wait_s the start goes on,
// and the allreduce's own deadline reports a missing rank with its usual
// error. Correctness never depends on it.
#pragma once

#include <cstdint>

#include "cpu/inprocess/inprocess_transport.h"

namespace jaxring {

// The longest a start waits for its peers (then it goes on without them).
constexpr double kGangMaxWaitS = 1.0;

// Counts this rank's arrival at `key` and, unless another operation is
// gathering, blocks until `world_size` ranks have arrived or max_wait_s has
// passed. Returns whether every rank had arrived when it returned.
bool gang_start_wait(const OpKey& key, int world_size, double max_wait_s);

// Operations with ranks still missing (for tests: drops to 0 once all
// arrive; an operation whose ranks never all come is forgotten a minute
// after its last arrival).
int64_t gang_start_pending();

}  // namespace jaxring
