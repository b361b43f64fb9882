#include "cpu/plan/plan_op.h"

#include <sstream>

#include "cpu/op_plan.h"
#include "cpu/net/frames.h"

namespace jaxring {

void PlanOp::set_desc(const OpDesc& d) {
  plan.reset(new TieredPlan(plan_for(d)));
  desc = d;
  has_desc = true;
}

bool PlanOp::mark_failed(const std::string& why) {
  if (failed) return false;
  failed = true;
  failed_flag.store(true);
  failed_at = Clock::now();
  error = why;
  return true;
}

std::vector<PlanWorker*> PlanOp::workers() const {
  std::vector<PlanWorker*> w;
  for (const auto& [rank, l] : locals) w.push_back(l.worker);
  return w;
}

bool PlanOp::expects_data_from(int p) const {
  for (const auto& [rank, local] : locals) {
    for (int ring = 0; ring < plan->num_rings(); ++ring) {
      for (int j = 0; j < plan->num_phases(); ++j) {
        const int prev = plan->prev_rank(ring, j, rank);
        if (prev == rank || process_of_rank[prev] != p) continue;
        const int64_t units = plan->num_units(ring, j, rank);
        for (int64_t u = 0; u < units; ++u) {
          if (plan->recv_span(ring, j, rank, u).count > 0) return true;
        }
      }
    }
  }
  return false;
}

std::string PlanOp::misrouted_staged_frame() const {
  if (!has_desc) return "";
  for (const auto& [where, ib] : inboxes) {
    const auto& [dst, ring] = where;
    for (const auto& [phase_unit, st] : ib.staged) {
      const int src = plan->prev_rank(ring, phase_unit.first, dst);
      const int runs_on = process_of_rank[src];
      if (st.from_process != runs_on) {
        std::ostringstream os;
        os << name() << ": protocol error: a frame from rank " << src
           << " came from process " << st.from_process << ", but rank " << src
           << " runs on process " << runs_on;
        return os.str();
      }
    }
  }
  return "";
}

std::string PlanOp::name() const {
  if (has_desc) return op_name(key, desc);
  std::ostringstream os;
  os << "jaxring allreduce (op " << key.op_id << ", group " << key.group
     << ", run " << key.run_id << ")";
  return os.str();
}

}  // namespace jaxring
