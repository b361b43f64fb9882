#include "cpu/dispatch.h"

#include <algorithm>

#include "failure.h"
#include "cpu/direct/host_direct.h"
#include "cpu/inprocess/inprocess_transport.h"
#include "cpu/net/tcp_transport.h"
#include "cpu/op_occurrence.h"
#include "cpu/plan/inprocess_plan_host.h"
#include "cpu/timeline.h"

namespace jaxring {

namespace {

enum class Where { kOneProcess, kProcesses, kAny };
enum class Link { kReal, kEmulated, kAny };
enum class Tiers { kFlat, kTiered, kAny };

struct Row {
  Algorithm algorithm;
  Where where;
  Link link;
  Tiers tiers;
  std::optional<Executor> executor;  // none: refused with `refusal`
  const char* refusal;
};

constexpr auto kRing = Algorithm::kRing;
constexpr auto kDirect = Algorithm::kDirect;
constexpr auto kExchange = Algorithm::kExchange;

// clang-format off
const Row kTable[] = {
  // algorithm  where               link             tiers          executor
  {kDirect,   Where::kAny,        Link::kEmulated, Tiers::kAny,    std::nullopt,
   "algorithm=direct has no transfers for link emulation to model"},
  {kDirect,   Where::kAny,        Link::kAny,      Tiers::kTiered, std::nullopt,
   "algorithm=direct has no tiers; a tiered topology runs the ring plan"},
  {kExchange, Where::kAny,        Link::kAny,      Tiers::kTiered, std::nullopt,
   "algorithm=exchange picks its own tiers; a tiered topology runs the ring "
   "plan"},
  {kRing,     Where::kProcesses,  Link::kEmulated, Tiers::kAny,    std::nullopt,
   "link emulation applies to the in-process transport only; across "
   "processes, shape the real network instead"},
  {kExchange, Where::kProcesses,  Link::kEmulated, Tiers::kAny,    std::nullopt,
   "link emulation applies to the in-process transport only; across "
   "processes, shape the real network instead"},
  {kDirect,   Where::kOneProcess, Link::kReal,     Tiers::kFlat,   Executor::kInProcessDirect,   ""},
  {kDirect,   Where::kProcesses,  Link::kReal,     Tiers::kFlat,   Executor::kHostDirect,        ""},
  {kRing,     Where::kOneProcess, Link::kEmulated, Tiers::kAny,    Executor::kInProcessEmulation, ""},
  {kExchange, Where::kOneProcess, Link::kEmulated, Tiers::kFlat,   Executor::kInProcessEmulation, ""},
  {kRing,     Where::kOneProcess, Link::kReal,     Tiers::kFlat,   Executor::kInProcessRing,     ""},
  {kRing,     Where::kOneProcess, Link::kReal,     Tiers::kTiered, Executor::kInProcessPlan,     ""},
  {kExchange, Where::kOneProcess, Link::kReal,     Tiers::kFlat,   Executor::kInProcessPlan,     ""},
  {kRing,     Where::kProcesses,  Link::kReal,     Tiers::kAny,    Executor::kTcpPlan,           ""},
  {kExchange, Where::kProcesses,  Link::kReal,     Tiers::kFlat,   Executor::kTcpPlan,           ""},
};
// clang-format on

template <typename E>
bool matches(E want, E have, E any) {
  return want == any || want == have;
}

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

const char* executor_name(Executor e) {
  switch (e) {
    case Executor::kInProcessRing: return "in-process ring";
    case Executor::kInProcessDirect: return "in-process direct";
    case Executor::kInProcessEmulation: return "in-process emulation";
    case Executor::kInProcessPlan: return "in-process plan";
    case Executor::kHostDirect: return "host direct";
    case Executor::kTcpPlan: return "plan over TCP";
  }
  return "?";
}

Route route(const OpDesc& desc, bool one_process) {
  const Where where = one_process ? Where::kOneProcess : Where::kProcesses;
  const Link link = desc.emulated() ? Link::kEmulated : Link::kReal;
  const Tiers tiers = desc.topology.size() > 1 ? Tiers::kTiered : Tiers::kFlat;
  for (const Row& row : kTable) {
    if (row.algorithm == desc.algorithm &&
        matches(row.where, where, Where::kAny) &&
        matches(row.link, link, Link::kAny) &&
        matches(row.tiers, tiers, Tiers::kAny)) {
      return {row.executor, row.executor ? "" : row.refusal};
    }
  }
  return {std::nullopt, std::string("no CPU executor runs algorithm ") +
                            algorithm_name(desc.algorithm)};
}

void cpu_allreduce(const OpKey& key, const OpDesc& desc, int rank, int device,
                   const std::vector<int>& process_of_rank, const void* in,
                   void* out, double timeout_s, Completion done) {
  const bool one_process =
      process_of_rank.empty() ||
      std::all_of(process_of_rank.begin(), process_of_rank.end(),
                  [&](int p) { return p == process_of_rank.front(); });
  const Route r = route(desc, one_process);
  if (!r.executor) {
    done(tagged(FailureKind::kInvalid, -1, "jaxring allreduce: " + r.refusal));
    return;
  }
  switch (*r.executor) {
    case Executor::kInProcessRing:
    case Executor::kInProcessDirect:
    case Executor::kInProcessEmulation:
      // One registry of in-process operations; each runs its algorithm
      // (inprocess_transport.cc, inprocess_direct.cc,
      // inprocess_emulation.cc) from its description.
      inprocess_allreduce(key, desc, rank, device, in, out, timeout_s,
                          std::move(done));
      return;
    case Executor::kInProcessPlan:
      inprocess_plan_allreduce(key, desc, rank, device, in, out, timeout_s,
                               std::move(done));
      return;
    case Executor::kHostDirect:
      host_direct_allreduce(
          next_occurrence(key, rank), desc, rank, process_of_rank, in, out,
          timeout_s, recorded_in_timeline(key, desc, device, std::move(done)));
      return;
    case Executor::kTcpPlan:
      tcp_allreduce(next_occurrence(key, rank), desc, rank, device,
                    process_of_rank, in, out, timeout_s,
                    recorded_in_timeline(key, desc, device, std::move(done)));
      return;
  }
}

}  // namespace jaxring
