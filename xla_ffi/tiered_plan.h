// The tiered plan: a multi-dimensional (PowerAI DDL style) chunked
// multi-ring allreduce over a topology d0 x d1 x ... x d(k-1).
//
// Pure, like the flat RingPlan: no I/O, no threads. A transport asks it what
// to move from whom to whom, and executes it.
//
// Ranks and tiers. Rank r has coordinates c_i = (r / (d0...d(i-1))) % d_i;
// tier 0 varies fastest, so it is the tightest group (the devices of one
// process, say), and the last tier the loosest (hosts). The group of rank r
// at tier i is the d_i ranks that share all of r's coordinates but c_i.
//
// Phases. Tiers of size 1 are skipped; with the remaining tiers t_0 < ... <
// t_(m-1) the plan runs 2m-1 phases:
//
//   reduce-scatter along t_0, ..., along t_(m-2),
//   a full allreduce (reduce-scatter + all-gather) along t_(m-1),
//   all-gather along t_(m-2), ..., along t_0.
//
// Each phase is a flat ring among the rank's group at that tier, over the
// rank's shard: the element range its earlier reduce-scatters left it (ring
// r's part of the buffer, then the segment it owned after each of them). A
// reduce-scatter runs the first g-1 steps of the flat 2(g-1)-step schedule
// (see plan.h), an all-gather the last g-1, the full allreduce all of them.
// So the bytes a rank sends on tier t_j are 2(g-1)/g of its shard there, n /
// (d_t_0 ... d_t_(j-1)): the tight tiers carry the full buffer, the loose
// ones only a slice of it.
//
// Rings. The buffer is split into K parts as in the flat plan; ring k's part
// goes through every phase on its own, and in every group even rings go in
// coordinate order and odd rings the other way, so both directions of a
// link carry data.
//
// What a transport does with a phase, per ring, for one rank (a "unit" is
// one chunk at one step: u = chunk * num_steps(phase) + local step):
//  * own contribution: the rank's input in the first phase; in a later
//    reduce-scatter or allreduce phase, the result of the phase before,
//    which is then in the rank's output and must be read before it is
//    overwritten (a transport keeps a copy of the shard).
//  * the first unit of each chunk (local step 0): a reduce-scatter or
//    allreduce phase sends its own contribution's chunk of send_segment; an
//    all-gather phase sends the finished chunk of its owned segment.
//  * unit u received: a reduce step stores received + own contribution, an
//    all-gather step stores what came; then, unless it was the phase's last
//    step, the same element range goes on to the next rank as unit u + 1
//    (recv_span(rank, u) == send_span(rank, u + 1)).
//  * a rank starts phase j + 1 of a ring once it has consumed every unit of
//    phase j of that ring. Units of a later phase that arrive early wait in
//    staging: their element range may still be in use by the current one.
//
// The exchange shape (PlanShape::kExchange: recursive doubling). Every phase
// works on the ring's whole part, with no reduce-scatter before it: a tier
// of size 2 is one exchange step (each rank sends its partner its whole
// shard and adds the partner's to its own, so both hold the same sum, as
// IEEE addition is commutative), and a larger tier a full ring allreduce.
// exchange_tiers(p) gives the tiers: the factors 2 of p, then what is left.
// 8 ranks: 3 steps, each of the whole buffer, against the ring's 14 of an
// eighth: fewer waits for small buffers, more bytes for large ones. The
// rules above hold unchanged (an exchange is a phase of one reduce step
// whose unit u is chunk u of the shard, sent to and received from the
// partner).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "plan.h"

namespace jaxring {

enum class PhaseKind : int {
  kReduceScatter = 0,
  kAllreduce = 1,
  kAllGather = 2,
  kExchange = 3,  // one reduce step with the partner (a tier of size 2)
};

enum class PlanShape : int {
  kNested = 0,    // reduce-scatter, allreduce, all-gather (above)
  kExchange = 1,  // recursive doubling (above)
};

// The tiers of the exchange shape for p ranks: a 2 per factor 2 of p, then
// the odd rest if it is more than 1 (p = 12: 2, 2, 3; p = 5: 5).
std::vector<int> exchange_tiers(int p);

struct Phase {
  PhaseKind kind = PhaseKind::kAllreduce;
  int tier = 0;        // index into the plan's dims
  int group_size = 1;  // dims[tier]
  // The steps of the flat 2(g-1)-step ring schedule this phase runs.
  int first_step = 0;
  int num_steps = 0;
};

// One point-to-point transfer of a tiered schedule.
struct TieredTransfer {
  int ring = 0;
  int phase = 0;
  int tier = 0;
  int64_t chunk = 0;
  int step = 0;         // local step, 0 .. num_steps(phase) - 1
  int64_t unit = 0;     // chunk * num_steps(phase) + step
  bool reduce = false;  // the receiver reduces (else it stores)
  int src_rank = 0;
  int dst_rank = 0;
  Span span;  // element range in the whole buffer
};

class TieredPlan {
 public:
  // dims: the size of each tier, tightest first; their product is the world
  // size. Throws std::invalid_argument on an empty topology, a tier below 1,
  // a ring count, element size or chunk size below 1, or a negative count.
  TieredPlan(std::vector<int> dims, int num_rings, int64_t count,
             int64_t elem_bytes, int64_t chunk_bytes,
             PlanShape shape = PlanShape::kNested);

  PlanShape shape() const { return shape_; }
  const std::vector<int>& dims() const { return dims_; }
  int world_size() const { return world_; }
  int num_rings() const { return rings_; }
  int64_t count() const { return count_; }
  int64_t elem_bytes() const { return elem_bytes_; }
  int64_t chunk_elems() const { return chunk_elems_; }
  int num_phases() const { return static_cast<int>(phases_.size()); }
  const Phase& phase(int j) const { return phases_[j]; }

  int coord(int rank, int tier) const;
  // The rank's position in its group's ring at phase j, and its neighbours.
  int position(int ring, int phase, int rank) const;
  int next_rank(int ring, int phase, int rank) const;
  int prev_rank(int ring, int phase, int rank) const;
  // The ranks of rank's group at phase j, in ring order.
  std::vector<int> group(int ring, int phase, int rank) const;

  // The element range phase j of `ring` works on for this rank; every rank
  // of the group has the same one.
  Span shard(int ring, int phase, int rank) const;
  // Chunk slots per segment of the shard (trailing ones may be empty); the
  // phase has chunks(...) * num_steps units.
  int64_t num_chunks(int ring, int phase, int rank) const;
  int64_t num_units(int ring, int phase, int rank) const;
  // Whether unit u's receiver reduces (else it stores).
  bool is_reduce_unit(int phase, int64_t u) const;
  // Whether `rank` reduces with its own contribution as the first operand
  // at phase j. A ring step adds the received partial first. In an
  // exchange both partners add the lower coordinate's value first, so they
  // compute the same bits even where an operation is not symmetric in its
  // operands (min of +0 and -0, the payload of two NaNs).
  bool own_first(int phase, int rank) const;
  // The element range this rank receives as unit u of (ring, phase), and the
  // one it sends as unit u (which its next rank receives as unit u).
  Span recv_span(int ring, int phase, int rank, int64_t u) const;
  Span send_span(int ring, int phase, int rank, int64_t u) const;

  // Every transfer, ring by ring, phase by phase, chunk by chunk, step by
  // step, rank by rank. Empty ones are left out. For inspection and tests.
  std::vector<TieredTransfer> transfers() const;

  // Bytes rank sends over the whole operation on the links of one tier (all
  // rings), computed without listing the transfers.
  int64_t bytes_sent(int rank, int tier) const;

  std::string describe() const;

 private:
  Span segment(int ring, int phase, int rank, int seg) const;

  PlanShape shape_;
  std::vector<int> dims_;
  std::vector<int64_t> stride_;  // rank = sum coord_i * stride_i
  int world_;
  int rings_;
  int64_t count_;
  int64_t elem_bytes_;
  int64_t chunk_elems_;
  std::vector<Phase> phases_;
};

}  // namespace jaxring
