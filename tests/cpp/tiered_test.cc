// Tiered plans among the threads of one process run on the plan executor:
// exact int32 sums for every rank, started in shuffled orders, into separate
// outputs and in place, plain and on an emulated two-tier cluster; and which
// tier of an emulated cluster a transfer crosses.
#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include <doctest/doctest.h>

#include "cpu/inprocess/link_pacing.h"
#include "cpu/plan/inprocess_plan_host.h"
#include "helpers.h"

TEST_CASE("tiered and exchange plans in one process: exact sums") {
  int64_t op_id = 50000;
  // Tiered plans of 8 ranks, then the exchange plan (empty dims) of p ranks.
  struct Case {
    std::vector<int> dims;
    int p;
  };
  const std::vector<Case> cases = {{{2, 4}, 8}, {{4, 2}, 8}, {{2, 2, 2}, 8},
                                   {{}, 2},     {{}, 3},     {{}, 6},
                                   {{}, 8},     {{}, 12}};
  for (const auto& [dims, p] : cases)
    for (int rings : {1, 3})
      for (int64_t count : {0, 1, 7, 1000, 100003})
        for (int variant = 0; variant < 3; ++variant) {
          const bool exchange = dims.empty();
          const bool in_place = variant == 1, emulated = variant == 2;
          INFO("dims=", dims.size(), "-tier p=", p, " rings=", rings,
               " count=", count, " variant=", variant);
          std::vector<std::vector<int32_t>> in(p, std::vector<int32_t>(count));
          std::vector<std::vector<int32_t>> out(
              p, std::vector<int32_t>(count, -1));
          std::vector<int32_t> expect(count, 0);
          for (int r = 0; r < p; ++r)
            for (int64_t i = 0; i < count; ++i) {
              in[r][i] = static_cast<int32_t>((r + 3) * (i % 11) - r);
              expect[i] += in[r][i];
            }
          jaxring::OpDesc desc;
          desc.type = jaxring::ElemType::kS32;
          desc.count = count;
          desc.world_size = p;
          desc.num_rings = rings;
          desc.chunk_bytes = 1024;
          desc.topology = dims;
          if (exchange) desc.algorithm = jaxring::Algorithm::kExchange;
          if (emulated && exchange) desc.link = {{p, 2e9, 5e-6}};
          if (emulated && !exchange) {
            desc.link = {{dims[0], 20e9, 1e-6}, {p / dims[0], 2e9, 5e-6}};
          }
          std::vector<int> order(p);
          std::iota(order.begin(), order.end(), 0);
          std::shuffle(order.begin(), order.end(),
                       std::mt19937(static_cast<unsigned>(op_id)));
          std::vector<const void*> ins;
          std::vector<void*> outs;
          for (int r = 0; r < p; ++r) {
            ins.push_back(in[r].data());
            outs.push_back(in_place ? in[r].data() : out[r].data());
          }
          CHECK(jaxring_test::run_ranks(order, jaxring::OpKey{2, op_id++, 0},
                                        desc, ins, outs, 30.0)
                    .empty());
          for (int r = 0; r < p; ++r) CHECK((in_place ? in : out)[r] == expect);
        }
  CHECK(jaxring::inprocess_plan_pending_ops() == 0);
}

TEST_CASE("the loosest tier a transfer crosses: 2 hosts of 4") {
  jaxring::OpDesc desc;
  desc.world_size = 8;
  desc.link = {{4, 1e9, 0}, {2, 1e8, 0}};
  CHECK(jaxring::crossed_tier(desc, 0, 3) == 0);
  CHECK(jaxring::crossed_tier(desc, 3, 4) == 1);
  CHECK(jaxring::crossed_tier(desc, 7, 0) == 1);
}
