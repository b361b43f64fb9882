#include "stream_schedule.h"

#include <algorithm>

namespace jaxring {

std::vector<StreamExchange> stream_exchanges(const TieredPlan& plan, int ring,
                                             int rank) {
  std::vector<StreamExchange> out;
  for (int j = 0; j < plan.num_phases(); ++j) {
    const int64_t units = plan.num_units(ring, j, rank);
    const int to = plan.next_rank(ring, j, rank);
    const int from = plan.prev_rank(ring, j, rank);
    for (int64_t u = 0; u < units; ++u) {
      StreamExchange x;
      x.phase = j;
      x.unit = u;
      x.send = plan.send_span(ring, j, rank, u);
      x.to = to;
      x.recv = plan.recv_span(ring, j, rank, u);
      x.from = from;
      x.reduce = plan.is_reduce_unit(j, u);
      if (x.send.count == 0 && x.recv.count == 0) continue;
      out.push_back(x);
    }
  }
  return out;
}

int64_t largest_reduce_receive(const TieredPlan& plan, int rank) {
  int64_t most = 0;
  for (int r = 0; r < plan.num_rings(); ++r) {
    for (const StreamExchange& x : stream_exchanges(plan, r, rank)) {
      if (x.reduce) most = std::max(most, x.recv.count);
    }
  }
  return most;
}

Span ring_part(const TieredPlan& plan, int ring) {
  return even_split(plan.count(), plan.num_rings(), ring);
}

}  // namespace jaxring
