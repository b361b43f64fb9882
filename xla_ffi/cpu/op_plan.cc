#include "cpu/op_plan.h"

#include <stdexcept>
#include <vector>

namespace jaxring {

TieredPlan plan_for(const OpDesc& d) {
  const bool exchange = d.algorithm == Algorithm::kExchange;
  if (exchange && !d.topology.empty()) {
    throw std::invalid_argument(
        "algorithm=exchange picks its own tiers; "
        "it takes no topology");
  }
  if (d.world_size < 1)
    throw std::invalid_argument("the world size is below 1");
  std::vector<int> dims = exchange ? exchange_tiers(d.world_size) : d.topology;
  if (dims.empty()) dims.push_back(d.world_size);
  int64_t product = 1;
  for (int t : dims) {
    if (t < 1 || product > d.world_size) break;  // stays far from overflow
    product *= t;
  }
  if (product != d.world_size) {
    throw std::invalid_argument(
        "the topology does not multiply to the "
        "world size");
  }
  return TieredPlan(dims, d.num_rings, d.count, elem_bytes(d.type),
                    d.chunk_bytes,
                    exchange ? PlanShape::kExchange : PlanShape::kNested);
}

bool is_flat_ring(const TieredPlan& plan) {
  return plan.shape() == PlanShape::kNested && plan.dims().size() == 1;
}

}  // namespace jaxring
