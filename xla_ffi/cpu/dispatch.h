// Which executor runs one rank's part of a CPU allreduce, chosen in one
// place: a table from (algorithm, where the ranks run, link emulation,
// tiers) to an executor (each in a folder of its own under cpu/) or a
// refusal. The first row that matches decides.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "cpu/operation.h"

namespace jaxring {

enum class Executor {
  kInProcessRing,       // inprocess/: the flat ring by direct reads
  kInProcessDirect,     // inprocess/: every rank reads every peer's buffer
  kInProcessEmulation,  // inprocess/: any plan, paced by emulated links
  kInProcessPlan,       // plan/: tiered plans and the exchange, one process
  kHostDirect,          // direct/: direct across processes of one host
  kTcpPlan,             // plan/ over net/: the plan executor across processes
};

const char* executor_name(Executor e);

// The executor for an operation, or the error that refuses it. Python
// refuses at trace time what the table refuses; the table guards
// hand-written calls. one_process: every rank of the group runs here.
struct Route {
  std::optional<Executor> executor;
  std::string refusal;
};
Route route(const OpDesc& desc, bool one_process);

// Runs rank `rank`'s part on the routed executor. process_of_rank[r] is the
// process running rank r of the group (empty: all in this process). Same
// contract as inprocess_allreduce.
void cpu_allreduce(const OpKey& key, const OpDesc& desc, int rank, int device,
                   const std::vector<int>& process_of_rank, const void* in,
                   void* out, double timeout_s, Completion done);

}  // namespace jaxring
