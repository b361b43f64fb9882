// The direct allreduce across the processes of one host, over the host
// segment (host_segment.h): chunk by chunk, every rank copies its input
// into its slot, reduces its 1/p of every slot into the result (the slots
// in rank order, so every rank gets the same bits), and copies the result
// out. Two synchronisations per chunk, and no byte crosses a socket.
//
// Why it looks the way it does:
//  * As in the other transports, the FFI handler hands its rank to a worker
//    thread and returns a future; here each local rank (by its place among
//    the operation's ranks in this process) has a worker, so a process of
//    several devices copies for them at once. The workers sleep on the
//    process's doorbell in the segment, which a peer
//    rings when a barrier it waits for is passed, an entry it waits for is
//    freed, or an operation it is in failed. A worker never blocks on one
//    operation, so independent allreduces may start in any order.
//  * Every wait has the operation's deadline. A peer that exits mid-op is
//    seen on its pid (not only by the timeout) and fails the operation on
//    every survivor with a peer_lost error naming it; a rank that fails for
//    another reason marks the entry failed, so its peers fail at once with
//    its error rather than at their own deadlines.
#pragma once

#include <cstdint>
#include <vector>

#include "cpu/operation.h"

namespace jaxring {

// Starts `rank`'s part of an allreduce whose ranks run in the processes
// process_of_rank[0..world) of this host. Same contract as tcp_allreduce:
// `in` and `out` stay valid until `done` is called, exactly once.
void host_direct_allreduce(const OpKey& key, const OpDesc& desc, int rank,
                           const std::vector<int>& process_of_rank,
                           const void* in, void* out, double timeout_s,
                           Completion done);

// Ranks the worker still holds (for tests: must drop to 0).
int64_t host_direct_pending();

}  // namespace jaxring
