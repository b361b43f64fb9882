// The dispatch table (cpu/dispatch.cc) against the rules it encodes, for
// every algorithm, place, link and tiering: refused combinations name what
// is wrong, and each other one has exactly its executor. Pure, but run
// before any thread exists, as it always was.
#include <optional>
#include <string>

#include <doctest/doctest.h>

#include "cpu/dispatch.h"
#include "helpers.h"

TEST_SUITE(jaxring_test::kBeforeThreads) {
  TEST_CASE("dispatch: every combination has its executor or its refusal") {
    using jaxring::Algorithm;
    using jaxring::Executor;
    for (Algorithm a : {Algorithm::kRing, Algorithm::kDirect,
                        Algorithm::kExchange, Algorithm::kNccl})
      for (bool one_process : {true, false})
        for (bool emulated : {true, false})
          for (bool tiered : {true, false}) {
            jaxring::OpDesc desc;
            desc.algorithm = a;
            desc.world_size = 4;
            if (emulated) desc.link = {jaxring::EmulatedTier{4, 1e9, 1e-6}};
            if (tiered) desc.topology = {2, 2};
            const jaxring::Route r = jaxring::route(desc, one_process);
            std::optional<Executor> want;
            std::string refused;
            if (a == Algorithm::kNccl) {
              refused = "no CPU executor";
            } else if (a == Algorithm::kDirect && emulated) {
              refused = "no transfers for link emulation";
            } else if (a == Algorithm::kDirect && tiered) {
              refused = "direct has no tiers";
            } else if (a == Algorithm::kExchange && tiered) {
              refused = "picks its own tiers";
            } else if (!one_process && emulated) {
              refused = "in-process transport only";
            } else if (a == Algorithm::kDirect) {
              want = one_process ? Executor::kInProcessDirect
                                 : Executor::kHostDirect;
            } else if (!one_process) {
              want = Executor::kTcpPlan;
            } else if (emulated) {
              want = Executor::kInProcessEmulation;
            } else if (tiered || a == Algorithm::kExchange) {
              want = Executor::kInProcessPlan;
            } else {
              want = Executor::kInProcessRing;
            }
            INFO("algorithm=", static_cast<int>(a),
                 " one_process=", one_process, " emulated=", emulated,
                 " tiered=", tiered, " refusal: ", r.refusal);
            CHECK(r.executor == want);
            CHECK((want || r.refusal.find(refused) != std::string::npos));
            CHECK((!want || r.refusal.empty()));
          }
  }
}
