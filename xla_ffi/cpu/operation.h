// What identifies one allreduce operation among a transport's, what its
// ranks must agree on, and how a transport reports its end: the types every
// CPU transport and the FFI handlers share.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "algorithm.h"
#include "reduce.h"

namespace jaxring {

// Which operation an arriving rank belongs to. run_id is XLA's id of one
// execution (the same on every device of it), op_id is assigned per call at
// lowering (jaxring/_src/call_sites.py), group tells the rings of a
// multi-axis mesh apart.
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

// One tier of the cluster that link emulation models in one process.
struct EmulatedTier {
  // Groups of the tier below (ranks, for tier 0) per group of this tier.
  int size = 1;
  double bytes_per_s = 0;
  double latency_s = 0;
  bool operator==(const EmulatedTier& o) const {
    return size == o.size && bytes_per_s == o.bytes_per_s &&
           latency_s == o.latency_s;
  }
};

// Whether two shape digests (OpDesc::shape_digest) may describe one call.
inline bool shapes_agree(uint32_t a, uint32_t b) {
  return a == 0 || b == 0 || a == b;
}

// What every rank of an operation must agree on.
struct OpDesc {
  ElemType type = ElemType::kF32;
  ReduceOp op = ReduceOp::kSum;
  int64_t count = 0;
  int world_size = 1;
  int num_rings = 1;
  int64_t chunk_bytes = 1 << 20;
  // Link emulation, in one process only (empty = off). With one tier, each
  // rank's outgoing transfers share one link of that bandwidth and arrive
  // that much later. With several, the ranks form an emulated cluster (see
  // link_pacing.h): tier t's groups hold link[t].size groups of tier t-1,
  // and a transfer crosses the link of the loosest tier whose group its two
  // ends do not share. Emulated time costs wall time (the ranks sleep until
  // the modelled link delivers), not CPU.
  std::vector<EmulatedTier> link;
  bool emulated() const { return !link.empty(); }
  Algorithm algorithm = Algorithm::kRing;
  // The ring plan's tiers, tightest first (see tiered_plan.h); empty means
  // one flat ring over all ranks. Only the TCP transport runs more than one.
  std::vector<int> topology;
  // The call's slot (call_sites.py): equal on every process for one place
  // of one program, whatever its shapes. Ops of different programs meet at
  // it, which is how a process tells that its peers run another program.
  // Not part of what ranks must agree on: 0 where unknown.
  int64_t slot_id = 0;
  // The operands' shapes: a digest that crosses processes (0: unknown,
  // agrees with any), and as text for this process's own calls (empty for
  // a description a peer sent). Processes that call one site with the same
  // element count in other shapes run different programs; their data must
  // not be paired.
  uint32_t shape_digest = 0;
  std::string shapes;
  bool operator==(const OpDesc& o) const {
    return type == o.type && op == o.op && count == o.count &&
           shapes_agree(shape_digest, o.shape_digest) &&
           algorithm == o.algorithm && topology == o.topology &&
           world_size == o.world_size && num_rings == o.num_rings &&
           chunk_bytes == o.chunk_bytes && link == o.link;
  }
  std::string describe() const;
};

// What a mismatch message adds when two processes' descriptions of one
// call differ in their shapes (by their shape digests): the texts of
// describe() could read the same, since a peer's description carries no
// shapes text. "" otherwise.
std::string shape_difference(uint32_t mine, uint32_t theirs);

// Called exactly once per allreduce a transport starts: from the worker
// thread of the calling device, or inline when the call is rejected before
// it starts (an argument that disagrees with a peer's). An empty optional
// means success.
using Completion = std::function<void(const std::optional<std::string>& error)>;

}  // namespace jaxring
