#include "ring_transport.h"

#include <algorithm>

#include "../failure.h"
#include "host_direct.h"
#include "inprocess_plan_host.h"
#include "op_occurrence.h"
#include "tcp_transport.h"

namespace jaxring {

void ring_allreduce(const OpKey& key, const OpDesc& desc, int rank, int device,
                    const std::vector<int>& process_of_rank, const void* in,
                    void* out, double timeout_s, Completion done) {
  const bool one_process =
      process_of_rank.empty() ||
      std::all_of(process_of_rank.begin(), process_of_rank.end(),
                  [&](int p) { return p == process_of_rank.front(); });
  if (desc.algorithm == Algorithm::kDirect && desc.emulated()) {
    // Python refuses this at trace time; this guards hand-written calls.
    done(tagged(FailureKind::kInvalid, -1,
                "jaxring allreduce: algorithm=direct has no transfers for link "
                "emulation to model"));
  } else if (desc.algorithm == Algorithm::kDirect && desc.topology.size() > 1) {
    // Python refuses this at trace time; this guards hand-written calls.
    done(tagged(FailureKind::kInvalid, -1,
                "jaxring allreduce: algorithm=direct has no tiers; a tiered "
                "topology runs the ring plan"));
  } else if (desc.algorithm == Algorithm::kExchange && desc.topology.size() > 1) {
    // Python refuses this at trace time; this guards hand-written calls.
    done(tagged(FailureKind::kInvalid, -1,
                "jaxring allreduce: algorithm=exchange picks its own tiers; a "
                "tiered topology runs the ring plan"));
  } else if (desc.algorithm == Algorithm::kDirect && !one_process) {
    // Across the processes of one host: over the host segment.
    host_direct_allreduce(next_occurrence(key, rank), desc, rank, process_of_rank, in,
                          out, timeout_s, std::move(done));
  } else if (one_process && !desc.emulated() &&
             (desc.topology.size() > 1 || desc.algorithm == Algorithm::kExchange)) {
    // A tiered plan or the exchange plan on real memory: the plan executor.
    inprocess_plan_allreduce(key, desc, rank, device, in, out, timeout_s,
                             std::move(done));
  } else if (one_process) {
    // The flat ring, the direct algorithm, or link emulation of any plan
    // (which moves the data at once and models the links' clock).
    inprocess_allreduce(key, desc, rank, device, in, out, timeout_s,
                        std::move(done));
  } else if (desc.emulated()) {
    // Python refuses this at trace time; this guards hand-written calls.
    done(tagged(FailureKind::kInvalid, -1,
                "jaxring allreduce: link emulation applies to the in-process "
                "transport only; across processes, shape the real network instead"));
  } else {
    tcp_allreduce(next_occurrence(key, rank), desc, rank, device, process_of_rank, in,
                  out, timeout_s, std::move(done));
  }
}

}  // namespace jaxring
