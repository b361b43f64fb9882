#include "tiered_plan.h"

#include <algorithm>
#include <sstream>
#include <stdexcept>

namespace jaxring {

std::vector<int> exchange_tiers(int p) {
  std::vector<int> dims;
  while (p > 1 && p % 2 == 0) {
    dims.push_back(2);
    p /= 2;
  }
  if (p > 1 || dims.empty()) dims.push_back(p);
  return dims;
}

TieredPlan::TieredPlan(std::vector<int> dims, int num_rings, int64_t count,
                       int64_t elem_bytes, int64_t chunk_bytes, PlanShape shape)
    : shape_(shape),
      dims_(std::move(dims)),
      world_(1),
      rings_(num_rings),
      count_(count),
      elem_bytes_(elem_bytes) {
  if (dims_.empty()) throw std::invalid_argument("the topology has no tiers");
  if (num_rings < 1) throw std::invalid_argument("num_rings must be >= 1");
  if (count < 0) throw std::invalid_argument("count must be >= 0");
  if (elem_bytes < 1) throw std::invalid_argument("elem_bytes must be >= 1");
  if (chunk_bytes < 1) throw std::invalid_argument("chunk_bytes must be >= 1");
  for (int d : dims_) {
    if (d < 1) throw std::invalid_argument("every tier must have size >= 1");
    stride_.push_back(world_);
    if (world_ > (1 << 30) / d) {
      throw std::invalid_argument("the topology has too many ranks");
    }
    world_ *= d;
  }
  chunk_elems_ = std::max<int64_t>(1, chunk_bytes / elem_bytes);
  std::vector<int> active;
  for (int t = 0; t < static_cast<int>(dims_.size()); ++t) {
    if (dims_[t] > 1) active.push_back(t);
  }
  const int m = static_cast<int>(active.size());
  auto add = [&](PhaseKind kind, int tier) {
    const int g = dims_[tier];
    Phase ph;
    ph.kind = kind;
    ph.tier = tier;
    ph.group_size = g;
    ph.first_step = kind == PhaseKind::kAllGather ? g - 1 : 0;
    ph.num_steps = kind == PhaseKind::kAllreduce ? 2 * (g - 1) : g - 1;
    phases_.push_back(ph);
  };
  if (shape_ == PlanShape::kExchange) {
    // Every tier on the whole part: an exchange (g - 1 = 1 step) where g is
    // 2, a full ring allreduce otherwise.
    for (int t : active) {
      add(dims_[t] == 2 ? PhaseKind::kExchange : PhaseKind::kAllreduce, t);
    }
    return;
  }
  for (int j = 0; j + 1 < m; ++j) add(PhaseKind::kReduceScatter, active[j]);
  if (m > 0) add(PhaseKind::kAllreduce, active[m - 1]);
  for (int j = m - 2; j >= 0; --j) add(PhaseKind::kAllGather, active[j]);
}

int TieredPlan::coord(int rank, int tier) const {
  return (rank / static_cast<int>(stride_[tier])) % dims_[tier];
}

namespace {
// Even rings go in coordinate order, odd rings the other way; the map is
// its own inverse.
int ring_position(int ring, int g, int c) {
  return ring % 2 == 0 ? c : (g - c) % g;
}
}  // namespace

int TieredPlan::position(int ring, int phase, int rank) const {
  const Phase& ph = phases_[phase];
  return ring_position(ring, ph.group_size, coord(rank, ph.tier));
}

std::vector<int> TieredPlan::group(int ring, int phase, int rank) const {
  const Phase& ph = phases_[phase];
  const int base =
      rank - coord(rank, ph.tier) * static_cast<int>(stride_[ph.tier]);
  std::vector<int> out(ph.group_size);
  for (int pos = 0; pos < ph.group_size; ++pos) {
    out[pos] = base + ring_position(ring, ph.group_size, pos) *
                          static_cast<int>(stride_[ph.tier]);
  }
  return out;
}

int TieredPlan::next_rank(int ring, int phase, int rank) const {
  const Phase& ph = phases_[phase];
  const int g = ph.group_size;
  const int pos = (position(ring, phase, rank) + 1) % g;
  const int c = ring_position(ring, g, pos);
  return rank + (c - coord(rank, ph.tier)) * static_cast<int>(stride_[ph.tier]);
}

int TieredPlan::prev_rank(int ring, int phase, int rank) const {
  const Phase& ph = phases_[phase];
  const int g = ph.group_size;
  const int pos = (position(ring, phase, rank) + g - 1) % g;
  const int c = ring_position(ring, g, pos);
  return rank + (c - coord(rank, ph.tier)) * static_cast<int>(stride_[ph.tier]);
}

Span TieredPlan::shard(int ring, int phase, int rank) const {
  if (shape_ == PlanShape::kExchange) return even_split(count_, rings_, ring);
  // The reduce-scatters before this phase's tier narrow ring's part down to
  // the segment the rank owned after each; an all-gather phase works on the
  // same shard as the reduce-scatter it mirrors.
  const int m = (num_phases() + 1) / 2;
  const int level = phase < m ? phase : num_phases() - 1 - phase;
  Span s = even_split(count_, rings_, ring);
  for (int j = 0; j < level; ++j) {
    const int g = phases_[j].group_size;
    const int owned = (position(ring, j, rank) + 1) % g;
    const Span seg = even_split(s.count, g, owned);
    s = Span{s.offset + seg.offset, seg.count};
  }
  return s;
}

Span TieredPlan::segment(int ring, int phase, int rank, int seg) const {
  const Span s = shard(ring, phase, rank);
  // An exchange sends the whole shard (its one step's "segment").
  if (phases_[phase].kind == PhaseKind::kExchange) return s;
  Span out = even_split(s.count, phases_[phase].group_size, seg);
  out.offset += s.offset;
  return out;
}

int64_t TieredPlan::num_chunks(int ring, int phase, int rank) const {
  // Segment 0 is the longest (even_split gives extras to the first pieces).
  const int64_t longest = segment(ring, phase, rank, 0).count;
  return (longest + chunk_elems_ - 1) / chunk_elems_;
}

int64_t TieredPlan::num_units(int ring, int phase, int rank) const {
  return num_chunks(ring, phase, rank) * phases_[phase].num_steps;
}

bool TieredPlan::is_reduce_unit(int phase, int64_t u) const {
  const Phase& ph = phases_[phase];
  return ph.first_step + u % ph.num_steps < ph.group_size - 1;
}

bool TieredPlan::own_first(int phase, int rank) const {
  const Phase& ph = phases_[phase];
  return ph.kind == PhaseKind::kExchange && coord(rank, ph.tier) == 0;
}

Span TieredPlan::send_span(int ring, int phase, int rank, int64_t u) const {
  const Phase& ph = phases_[phase];
  const int step = ph.first_step + static_cast<int>(u % ph.num_steps);
  const int64_t c = u / ph.num_steps;
  const int seg =
      ring_send_segment(ph.group_size, position(ring, phase, rank), step);
  const Span s = segment(ring, phase, rank, seg);
  const int64_t begin = std::min(s.count, c * chunk_elems_);
  const int64_t end = std::min(s.count, begin + chunk_elems_);
  return Span{s.offset + begin, end - begin};
}

Span TieredPlan::recv_span(int ring, int phase, int rank, int64_t u) const {
  return send_span(ring, phase, prev_rank(ring, phase, rank), u);
}

std::vector<TieredTransfer> TieredPlan::transfers() const {
  std::vector<TieredTransfer> out;
  for (int r = 0; r < rings_; ++r) {
    for (int j = 0; j < num_phases(); ++j) {
      const Phase& ph = phases_[j];
      // Every rank of a group has the same number of chunks; groups may
      // differ by one element, so take the largest.
      int64_t chunks = 0;
      for (int rank = 0; rank < world_; ++rank) {
        chunks = std::max(chunks, num_chunks(r, j, rank));
      }
      for (int64_t c = 0; c < chunks; ++c) {
        for (int t = 0; t < ph.num_steps; ++t) {
          const int64_t u = c * ph.num_steps + t;
          for (int rank = 0; rank < world_; ++rank) {
            if (c >= num_chunks(r, j, rank)) continue;
            const Span span = send_span(r, j, rank, u);
            if (span.count == 0) continue;
            TieredTransfer x;
            x.ring = r;
            x.phase = j;
            x.tier = ph.tier;
            x.chunk = c;
            x.step = t;
            x.unit = u;
            x.reduce = is_reduce_unit(j, u);
            x.src_rank = rank;
            x.dst_rank = next_rank(r, j, rank);
            x.span = span;
            out.push_back(x);
          }
        }
      }
    }
  }
  return out;
}

int64_t TieredPlan::bytes_sent(int rank, int tier) const {
  int64_t elems = 0;
  for (int r = 0; r < rings_; ++r) {
    for (int j = 0; j < num_phases(); ++j) {
      const Phase& ph = phases_[j];
      if (ph.tier != tier) continue;
      const int pos = position(r, j, rank);
      for (int t = 0; t < ph.num_steps; ++t) {
        const int seg =
            ring_send_segment(ph.group_size, pos, ph.first_step + t);
        elems += segment(r, j, rank, seg).count;
      }
    }
  }
  return elems * elem_bytes_;
}

std::string TieredPlan::describe() const {
  std::ostringstream os;
  os << "TieredPlan(dims=";
  for (size_t i = 0; i < dims_.size(); ++i) os << (i ? "x" : "") << dims_[i];
  os << ", rings=" << rings_ << ", count=" << count_
     << ", elem_bytes=" << elem_bytes_ << ", chunk_elems=" << chunk_elems_;
  if (shape_ == PlanShape::kExchange) os << ", shape=exchange";
  os << ")";
  return os.str();
}

}  // namespace jaxring
