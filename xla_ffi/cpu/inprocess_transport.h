// In-process transport: executes a RingPlan among the virtual CPU devices of
// one process (--xla_force_host_platform_device_count=N).
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
//    a modelled clock (see run_emulated in the .cc): a worker per rank
//    stepping the ring would wait for a core at every step.
//  * Every wait has a deadline; a missing peer becomes an error naming it.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "../reduce.h"

namespace jaxring {

// Which operation an arriving rank belongs to. run_id is XLA's id of one
// execution (the same on every device of it), op_id is assigned per call
// site at trace time, group tells the rings of a multi-axis mesh apart.
struct OpKey {
  int64_t run_id = 0;
  int64_t op_id = 0;
  int64_t group = 0;
  bool operator<(const OpKey& o) const {
    if (run_id != o.run_id) return run_id < o.run_id;
    if (op_id != o.op_id) return op_id < o.op_id;
    return group < o.group;
  }
};

// How the ranks of one process combine their buffers.
enum class Algorithm : int {
  // The ring plan: 2(p-1) steps of neighbour transfers. The only algorithm
  // across processes and under link emulation.
  kRing = 0,
  // In one process only: rank i reduces segment i of every rank's input and
  // writes it into every rank's output. Each byte is read once and written
  // once per rank, against about five times for a ring over shared memory,
  // and there are two synchronisations instead of 2(p-1).
  kDirect = 1,
};

// What every rank of an operation must agree on.
struct OpDesc {
  ElemType type = ElemType::kF32;
  ReduceOp op = ReduceOp::kSum;
  int64_t count = 0;
  int world_size = 1;
  int num_rings = 1;
  int64_t chunk_bytes = 1 << 20;
  // Link emulation (0 = off): each device's outgoing transfers share one
  // link of this bandwidth, and each transfer arrives this much later. The
  // data moves once every rank is here; each rank sleeps until the modelled
  // link delivers its last transfer, so emulated time costs wall time, not
  // CPU.
  double link_bytes_per_s = 0;
  double link_latency_s = 0;
  Algorithm algorithm = Algorithm::kRing;
  // The ring plan's tiers, tightest first (see tiered_plan.h); empty means
  // one flat ring over all ranks. Only the TCP transport runs more than one.
  std::vector<int> topology;
  // The call's slot (call_sites.py): equal on every process for one place
  // of one program, whatever its shapes. Ops of different programs meet at
  // it, which is how a process tells that its peers run another program.
  // Not part of what ranks must agree on: 0 where unknown.
  int64_t slot_id = 0;
  bool operator==(const OpDesc& o) const {
    return type == o.type && op == o.op && count == o.count &&
           algorithm == o.algorithm && topology == o.topology &&
           world_size == o.world_size && num_rings == o.num_rings &&
           chunk_bytes == o.chunk_bytes &&
           link_bytes_per_s == o.link_bytes_per_s &&
           link_latency_s == o.link_latency_s;
  }
  std::string describe() const;
};

// Called exactly once per inprocess_allreduce(): from the worker thread of the
// calling device, or inline when the call is rejected before it starts (an
// argument that disagrees with a peer's). An empty optional means success.
using Completion = std::function<void(const std::optional<std::string>& error)>;

// Starts `rank`'s part of an allreduce. `in` and `out` must stay valid until
// `done` is called. timeout_s bounds the whole wait for peers.
void inprocess_allreduce(const OpKey& key, const OpDesc& desc, int rank,
                         int device, const void* in, void* out,
                         double timeout_s, Completion done);

// Operations currently held by the transport (for tests: must drop to 0).
int64_t inprocess_pending_ops();

}  // namespace jaxring
