// Split-phase allreduce: a start that returns at once and a finish that
// completes when the result is ready, over either transport.
//
// jaxring.overlap issues a bucket's allreduce as soon as its gradients exist
// and waits for it only where the result is first used. XLA sees two custom
// calls, start and done, that it can place apart; data dependencies pin them.
//
// Why the transport owns the buffers: between start and done XLA is free to
// reuse start's operand buffers, and if the execution is abandoned it frees
// everything it owns. A copy of the inputs and a result buffer owned here stay
// valid for as long as any peer may read them, whatever XLA does. The cost is
// one copy in and one copy out, small next to the ring's own traffic.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "cpu/dispatch.h"

namespace jaxring {

struct ConstBytes {
  const void* data;
  size_t size;
};
struct MutableBytes {
  void* data;
  size_t size;
};

// Copies `inputs` (concatenated, in order) into transport-owned memory and
// starts rank's part of the allreduce described by key/desc. With `gang`, and
// every rank in this process, it then waits for the other ranks to start too
// (see gang_start.h). Returns an error if it cannot start (the custom call
// then fails the execution).
std::optional<std::string> split_phase_start(
    const OpKey& key, const OpDesc& desc, int rank, int device,
    const std::vector<int>& process_of_rank,
    const std::vector<ConstBytes>& inputs, double timeout_s, bool gang);

// Completes the operation started on `device` in run `run_id` as op_id:
// once the result is ready it is copied into `outputs` (split in order) and
// `done` is called, from this device's worker or inline if it is ready now.
void split_phase_finish(int64_t run_id, int device, int64_t op_id,
                        std::vector<MutableBytes> outputs, Completion done);

// Started operations not yet finished (for tests: must drop to 0).
int64_t split_phase_unfinished_starts();

}  // namespace jaxring
