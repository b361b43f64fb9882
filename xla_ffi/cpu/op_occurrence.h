// Each time one allreduce runs within one run: its occurrence.
//
// XLA gives a call one run id per execution and jaxring one op id per call
// site, so the key (run id, op id, group) of an allreduce in a loop's body
// (scan, while_loop, fori_loop) is the same at every iteration. In one
// process the transports take such repeats first in, first out. Across
// processes an operation is found by its key (frames name it; the host
// segment's entries hold it), so a peer's next iteration would meet this
// one's: every rank numbers the times it runs each key, and the n-th time
// (n > 0) runs under an op id mixed with n. Every process runs the same
// program, so the n-th time is the same operation on every rank.
#pragma once

#include <cstdint>

#include "cpu/operation.h"

namespace jaxring {

// The key of this rank's next time of `key` in this process: `key` itself
// the first time, then the op id mixed with the count.
OpKey next_occurrence(const OpKey& key, int rank);

}  // namespace jaxring
