// Picks the transport for one rank's part of an allreduce: the in-process
// transport when every rank of the group runs in this process (its plan host
// for a tiered plan), TCP when the group spans processes.
#pragma once

#include <vector>

#include "cpu/inprocess/inprocess_transport.h"

namespace jaxring {

// process_of_rank[r] is the process running rank r of the group (empty: all
// in this process). Same contract as inprocess_allreduce.
void ring_allreduce(const OpKey& key, const OpDesc& desc, int rank, int device,
                    const std::vector<int>& process_of_rank, const void* in,
                    void* out, double timeout_s, Completion done);

}  // namespace jaxring
