// The plan an operation's description names: the exchange shape for
// algorithm=exchange, else the nested tiered plan of desc.topology (one
// flat ring when it is empty). Shared by the transports that run plans, so
// that they agree on what a description means.
#pragma once

#include "tiered_plan.h"
#include "cpu/operation.h"

namespace jaxring {

// Throws std::invalid_argument on a description no plan fits (an exchange
// given a topology, a world size below 1, a topology whose product is not
// the world size) or that TieredPlan refuses.
TieredPlan plan_for(const OpDesc& desc);

// Whether a plan is the flat ring: one tier and the nested shape.
bool is_flat_ring(const TieredPlan& plan);

}  // namespace jaxring
