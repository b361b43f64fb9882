#include "plan.h"

#include <algorithm>
#include <sstream>
#include <stdexcept>

namespace jaxring {

Span even_split(int64_t n, int64_t k, int64_t i) {
  // The first n % k pieces get one extra item.
  const int64_t base = n / k;
  const int64_t extra = n % k;
  const int64_t offset = i * base + std::min(i, extra);
  return Span{offset, base + (i < extra ? 1 : 0)};
}

RingPlan::RingPlan(int world_size, int num_rings, int64_t count,
                   int64_t elem_bytes, int64_t chunk_bytes)
    : world_(world_size),
      rings_(num_rings),
      count_(count),
      elem_bytes_(elem_bytes) {
  if (world_size < 1) throw std::invalid_argument("world_size must be >= 1");
  if (num_rings < 1) throw std::invalid_argument("num_rings must be >= 1");
  if (count < 0) throw std::invalid_argument("count must be >= 0");
  if (elem_bytes < 1) throw std::invalid_argument("elem_bytes must be >= 1");
  if (chunk_bytes < 1) throw std::invalid_argument("chunk_bytes must be >= 1");
  // A chunk holds at least one element, whatever chunk_bytes says.
  chunk_elems_ = std::max<int64_t>(1, chunk_bytes / elem_bytes);
  order_.resize(rings_);
  position_.resize(rings_);
  for (int r = 0; r < rings_; ++r) {
    order_[r].resize(world_);
    position_[r].resize(world_);
    for (int i = 0; i < world_; ++i) {
      // Odd rings run backwards: on a full-duplex link between neighbours
      // the two directions then carry different rings at the same time.
      order_[r][i] = (r % 2 == 0) ? i : (world_ - i) % world_;
    }
    for (int i = 0; i < world_; ++i) position_[r][order_[r][i]] = i;
  }
}

int RingPlan::next_rank(int ring, int rank) const {
  return order_[ring][(position_[ring][rank] + 1) % world_];
}

int RingPlan::prev_rank(int ring, int rank) const {
  return order_[ring][(position_[ring][rank] + world_ - 1) % world_];
}

Span RingPlan::part(int ring) const { return even_split(count_, rings_, ring); }

Span RingPlan::segment(int ring, int seg) const {
  const Span p = part(ring);
  Span s = even_split(p.count, world_, seg);
  s.offset += p.offset;
  return s;
}

int64_t RingPlan::num_chunks(int ring) const {
  // Segment 0 is the longest (even_split gives extras to the first pieces).
  const int64_t longest = segment(ring, 0).count;
  return (longest + chunk_elems_ - 1) / chunk_elems_;
}

Span RingPlan::chunk(int ring, int seg, int64_t c) const {
  const Span s = segment(ring, seg);
  const int64_t begin = std::min(s.count, c * chunk_elems_);
  const int64_t end = std::min(s.count, begin + chunk_elems_);
  return Span{s.offset + begin, end - begin};
}

int ring_send_segment(int p, int pos, int step) {
  // Reduce-scatter step t: send the partial sum of segment pos - t.
  // All-gather step t' = t - (p-1): send the finished segment pos + 1 - t'.
  const int t = step < p - 1 ? step : step - (p - 1) - 1;
  return (((pos - t) % p) + p) % p;
}

int RingPlan::send_segment(int pos, int step) const {
  return ring_send_segment(world_, pos, step);
}

int RingPlan::recv_segment(int pos, int step) const {
  return send_segment((pos + world_ - 1) % world_, step);
}

std::vector<Transfer> RingPlan::transfers() const {
  std::vector<Transfer> out;
  for (int r = 0; r < rings_; ++r) {
    const int64_t chunks = num_chunks(r);
    for (int64_t c = 0; c < chunks; ++c) {
      for (int t = 0; t < num_steps(); ++t) {
        for (int pos = 0; pos < world_; ++pos) {
          const int seg = send_segment(pos, t);
          const Span span = chunk(r, seg, c);
          if (span.count == 0) continue;
          Transfer x;
          x.ring = r;
          x.chunk = c;
          x.step = t;
          x.reduce = is_reduce_step(t);
          x.src_rank = order_[r][pos];
          x.dst_rank = order_[r][(pos + 1) % world_];
          x.segment = seg;
          x.span = span;
          out.push_back(x);
        }
      }
    }
  }
  return out;
}

int64_t RingPlan::bytes_sent(int rank) const {
  int64_t elems = 0;
  for (int r = 0; r < rings_; ++r) {
    const int pos = position_[r][rank];
    for (int t = 0; t < num_steps(); ++t) {
      elems += segment(r, send_segment(pos, t)).count;
    }
  }
  return elems * elem_bytes_;
}

std::string RingPlan::describe() const {
  std::ostringstream os;
  os << "RingPlan(world_size=" << world_ << ", rings=" << rings_
     << ", count=" << count_ << ", elem_bytes=" << elem_bytes_
     << ", chunk_elems=" << chunk_elems_ << ")";
  return os.str();
}

}  // namespace jaxring
