// Tiered plans among the devices of one process: the plan executor
// (plan_executor.h) with every rank local, so every unit moves in memory.
// (Under link emulation every plan runs on the in-process transport
// instead, which models the links' clock: inprocess_emulation.cc.)
//
// Why not the in-process transport's direct reads: a tiered plan's later
// phases reduce into element ranges an earlier phase still reads, which the
// executor handles with per-phase staging and a copy of each rank's own
// contribution; reading a peer's buffer in place would need the same care
// again. The flat ring and the direct algorithm keep their own, faster,
// in-process path (inprocess_transport.h).
#pragma once

#include <cstdint>

#include "cpu/operation.h"

namespace jaxring {

// Starts `rank`'s part of an allreduce whose ranks all run in this process,
// on the tiered plan desc.topology names. Same contract as
// inprocess_allreduce.
void inprocess_plan_allreduce(const OpKey& key, const OpDesc& desc, int rank,
                              int device, const void* in, void* out,
                              double timeout_s, Completion done);

// Operations currently held (for tests: must drop to 0).
int64_t inprocess_plan_pending_ops();

}  // namespace jaxring
