#include "cpu/ring_transport.h"

#include <algorithm>

#include "failure.h"
#include "reduce.h"
#include "cpu/direct/host_direct.h"
#include "cpu/plan/inprocess_plan_host.h"
#include "cpu/op_occurrence.h"
#include "cpu/net/tcp_transport.h"
#include "cpu/timeline.h"

namespace jaxring {

namespace {

// Across processes the transports run the n-th time of a key under an op
// id mixed with n (op_occurrence.h), and the timeline names spans by op
// id: so the span of an allreduce across processes is recorded here, under
// the op id its call site was given, from this rank's start to its end
// (only this process's ranks' starts are known, so no peers' join time).
Completion recorded_in_timeline(const OpKey& key, const OpDesc& desc,
                                int device, Completion done) {
  if (!timeline_enabled()) return done;
  return [key, device, bytes = desc.count * elem_bytes(desc.type),
          rings = desc.num_rings, begin = timeline_now_ns(),
          done = std::move(done)](const std::optional<std::string>& error) {
    if (!error) {
      timeline_record({device, key.run_id, key.op_id, bytes, rings, begin,
                       timeline_now_ns(), -1});
    }
    done(error);
  };
}

}  // namespace

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
  } else if (desc.algorithm == Algorithm::kExchange &&
             desc.topology.size() > 1) {
    // Python refuses this at trace time; this guards hand-written calls.
    done(tagged(FailureKind::kInvalid, -1,
                "jaxring allreduce: algorithm=exchange picks its own tiers; a "
                "tiered topology runs the ring plan"));
  } else if (desc.algorithm == Algorithm::kDirect && !one_process) {
    // Across the processes of one host: over the host segment.
    host_direct_allreduce(
        next_occurrence(key, rank), desc, rank, process_of_rank, in, out,
        timeout_s, recorded_in_timeline(key, desc, device, std::move(done)));
  } else if (one_process && !desc.emulated() &&
             (desc.topology.size() > 1 ||
              desc.algorithm == Algorithm::kExchange)) {
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
    done(tagged(
        FailureKind::kInvalid, -1,
        "jaxring allreduce: link emulation applies to the in-process "
        "transport only; across processes, shape the real network instead"));
  } else {
    tcp_allreduce(next_occurrence(key, rank), desc, rank, device,
                  process_of_rank, in, out, timeout_s,
                  recorded_in_timeline(key, desc, device, std::move(done)));
  }
}

}  // namespace jaxring
