// The ring plan: a pure description of a chunked multi-ring allreduce.
//
// No I/O and no threads live here. A transport asks the plan which element
// range to move from whom to whom at each step, and executes it. Keeping the
// schedule pure is what makes it testable without any transport at all.
//
// Layout of the buffer (n elements, p ranks, K rings):
//
//   | part 0 (ring 0) | part 1 (ring 1) | ... | part K-1 |
//   each part:  | seg 0 | seg 1 | ... | seg p-1 |
//   each seg :  | chunk 0 | chunk 1 | ... |        (chunk_elems elements each)
//
// Ring r visits the ranks in order_[r]; even rings go 0,1,..,p-1 and odd
// rings go the other way so both directions of a full-duplex link carry data.
// The rank at ring position i, at step t (0 <= t < 2(p-1)), sends one chunk
// of segment send_segment(i, t) to position i+1 and receives one chunk of
// segment recv_segment(i, t) from position i-1. The first p-1 steps are the
// reduce-scatter (the receiver reduces the chunk into its partial sum), the
// last p-1 the all-gather (the receiver stores the fully reduced chunk).
// Chunks are pipelined: chunk c of step t only depends on chunk c of step
// t-1, so a transport may run chunk c+1 of step t while chunk c moves on.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace jaxring {

// A half-open element range [offset, offset + count).
struct Span {
  int64_t offset = 0;
  int64_t count = 0;
};

// One point-to-point transfer of the schedule.
struct Transfer {
  int ring = 0;
  int64_t chunk = 0;
  int step = 0;         // 0 .. 2(p-1)-1
  bool reduce = false;  // true in the reduce-scatter phase
  int src_rank = 0;
  int dst_rank = 0;
  int segment = 0;  // which segment of the ring's part
  Span span;        // element range in the whole buffer
};

class RingPlan {
 public:
  // Throws std::invalid_argument on a world size, ring count, element size or
  // chunk size below 1, or a negative element count.
  RingPlan(int world_size, int num_rings, int64_t count, int64_t elem_bytes,
           int64_t chunk_bytes);

  int world_size() const { return world_; }
  int num_rings() const { return rings_; }
  int64_t count() const { return count_; }
  int64_t elem_bytes() const { return elem_bytes_; }
  int64_t chunk_elems() const { return chunk_elems_; }
  int num_steps() const { return 2 * (world_ - 1); }

  // order(r)[i] is the rank at position i of ring r; position(r, rank) is the
  // inverse.
  const std::vector<int>& order(int ring) const { return order_[ring]; }
  int position(int ring, int rank) const { return position_[ring][rank]; }
  int next_rank(int ring, int rank) const;
  int prev_rank(int ring, int rank) const;

  Span part(int ring) const;
  Span segment(int ring, int seg) const;
  // Chunks per segment of ring r; every segment of a ring has this many
  // chunk slots, the trailing ones of shorter segments may be empty.
  int64_t num_chunks(int ring) const;
  Span chunk(int ring, int seg, int64_t c) const;

  // Which segment the rank at ring position pos sends / receives at step t.
  int send_segment(int pos, int step) const;
  int recv_segment(int pos, int step) const;
  bool is_reduce_step(int step) const { return step < world_ - 1; }
  // After the reduce-scatter the rank at position pos owns this segment.
  int owned_segment(int pos) const { return (pos + 1) % world_; }

  // Every transfer, ring by ring, chunk by chunk, step by step, position by
  // position. Empty chunks are left out. Meant for inspection and tests.
  std::vector<Transfer> transfers() const;

  // Bytes rank sends over the whole operation (all rings), computed without
  // listing the transfers, so it works for any count.
  int64_t bytes_sent(int rank) const;

  std::string describe() const;

 private:
  int world_;
  int rings_;
  int64_t count_;
  int64_t elem_bytes_;
  int64_t chunk_elems_;
  std::vector<std::vector<int>> order_;
  std::vector<std::vector<int>> position_;
};

// Splits n items into k near-equal pieces; piece i gets floor or ceil.
Span even_split(int64_t n, int64_t k, int64_t i);

// The segment the rank at position pos of a p-rank ring sends at step t of
// the 2(p-1)-step schedule (shared by the flat and the tiered plans).
int ring_send_segment(int p, int pos, int step);

}  // namespace jaxring
