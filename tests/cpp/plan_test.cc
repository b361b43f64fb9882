// The plans, checked by replaying them over memory: the flat ring plan
// (every rank must end with each rank's contribution exactly once), and the
// stream-ordered schedule the CUDA backend enqueues, run under NCCL's
// matching rule and compared bit for bit with the CPU executor's result.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <doctest/doctest.h>

#include "helpers.h"
#include "plan.h"
#include "reduce.h"
#include "stream_schedule.h"
#include "tiered_plan.h"

namespace {

// Replays the plan on per-rank contribution counts.
void check_plan(int p, int rings, int64_t count, int64_t chunk) {
  INFO("p=", p, " rings=", rings, " count=", count, " chunk=", chunk);
  jaxring::RingPlan plan(p, rings, count, 4, chunk);
  std::vector<std::vector<int>> have(p * count, std::vector<int>(p, 0));
  auto at = [&](int rank, int64_t i) -> std::vector<int>& {
    return have[rank * count + i];
  };
  for (int r = 0; r < p; ++r)
    for (int64_t i = 0; i < count; ++i) at(r, i)[r] = 1;
  for (const auto& t : plan.transfers()) {
    for (int64_t i = t.span.offset; i < t.span.offset + t.span.count; ++i) {
      std::vector<int> v = at(t.src_rank, i);
      if (t.reduce) v[t.dst_rank] += 1;
      at(t.dst_rank, i) = v;
    }
  }
  for (int r = 0; r < p; ++r)
    for (int64_t i = 0; i < count; ++i)
      for (int s = 0; s < p; ++s)
        if (at(r, i)[s] != 1) CHECK(at(r, i)[s] == 1);  // asserted if wrong
}

// The stream-ordered schedule (what the CUDA backend enqueues) run over
// memory with NCCL's matching rule: a send completes when the receiving
// rank's stream has reached the receive of the same unit from it, and an
// exchange ends once its send and its receive have. Every rank must finish
// (no deadlock), reduce receives must fit the scratch the schedule sizes,
// and the results must be the executor's bits.
std::vector<std::vector<float>> stream_ordered_allreduce(
    const jaxring::TieredPlan& plan,
    const std::vector<std::vector<float>>& in) {
  const int p = plan.world_size();
  std::vector<std::vector<float>> out = in;
  struct Stream {
    std::vector<jaxring::StreamExchange> xs;
    size_t next = 0;
    bool sent = false, received = false;
    std::vector<float> scratch;
  };
  for (int r = 0; r < plan.num_rings(); ++r) {
    std::vector<Stream> s(p);
    for (int rank = 0; rank < p; ++rank) {
      s[rank].xs = jaxring::stream_exchanges(plan, r, rank);
      s[rank].scratch.resize(jaxring::largest_reduce_receive(plan, rank));
      for (const auto& x : s[rank].xs) {
        // Within one exchange the two spans never overlap, so a stream may
        // run the send and the receive side by side.
        const bool apart = x.send.offset + x.send.count <= x.recv.offset ||
                           x.recv.offset + x.recv.count <= x.send.offset ||
                           x.send.count == 0 || x.recv.count == 0;
        CHECK(apart);
      }
    }
    for (bool progress = true; progress;) {
      progress = false;
      for (int a = 0; a < p; ++a) {
        Stream& me = s[a];
        if (me.next == me.xs.size()) continue;
        const jaxring::StreamExchange& x = me.xs[me.next];
        if (x.recv.count == 0) me.received = true;
        if (!me.sent && x.send.count == 0) me.sent = true;
        if (!me.sent) {
          Stream& peer = s[x.to];
          if (peer.next < peer.xs.size() && !peer.received) {
            const jaxring::StreamExchange& y = peer.xs[peer.next];
            if (y.phase == x.phase && y.unit == x.unit && y.from == a) {
              CHECK((y.recv.offset == x.send.offset &&
                     y.recv.count == x.send.count));
              float* dst = out[x.to].data() + y.recv.offset;
              const float* src = out[a].data() + x.send.offset;
              if (y.reduce) {
                CHECK(y.recv.count <=
                      static_cast<int64_t>(peer.scratch.size()));
                std::copy(src, src + x.send.count, peer.scratch.data());
                jaxring::reduce(jaxring::ElemType::kF32,
                                jaxring::ReduceOp::kSum, dst, dst,
                                peer.scratch.data(), y.recv.count);
              } else {
                std::copy(src, src + x.send.count, dst);
              }
              peer.received = true;
              me.sent = true;
              progress = true;
            }
          }
        }
        if (me.sent && me.received) {
          ++me.next;
          me.sent = me.received = false;
          progress = true;
        }
      }
    }
    for (int rank = 0; rank < p; ++rank)
      CHECK(s[rank].next == s[rank].xs.size());
  }
  return out;
}

}  // namespace

TEST_CASE("ring plan: every rank ends with each contribution exactly once") {
  for (int p = 1; p <= 9; ++p)
    for (int rings = 1; rings <= 4; ++rings)
      for (int64_t count : {0, 1, 7, 100, 1000})
        check_plan(p, rings, count, 12);
}

TEST_CASE("stream schedule: no deadlock, fits its scratch, executor's bits") {
  const std::vector<std::vector<int>> topologies = {
      {2}, {3}, {5}, {8}, {2, 4}, {4, 2}, {2, 2, 2}, {1, 3}};
  int64_t op_id = 70000;
  for (const auto& dims : topologies)
    for (int rings : {1, 3})
      for (int64_t count : {0, 1, 7, 1000, 100003}) {
        int p = 1;
        for (int d : dims) p *= d;
        const int64_t chunk_bytes = 1024;
        jaxring::OpDesc desc;
        desc.num_rings = rings;
        desc.chunk_bytes = chunk_bytes;
        if (dims.size() > 1) desc.topology = dims;
        std::vector<std::string> errors;
        double wall = 0;
        // float_allreduce's inputs, made again from the same seed.
        std::vector<std::vector<float>> in(p, std::vector<float>(count));
        std::mt19937 gen(static_cast<unsigned>(op_id));
        std::normal_distribution<float> normal(0.f, 1e3f);
        for (auto& v : in)
          for (auto& x : v) x = normal(gen);
        const auto executed = jaxring_test::float_allreduce(
            p, count, desc, op_id, 30, &errors, &wall);
        CHECK(errors.empty());
        const jaxring::TieredPlan plan(dims, rings, count, 4, chunk_bytes);
        const auto streamed = stream_ordered_allreduce(plan, in);
        for (int r = 0; r < p; ++r) {
          const bool same =
              count == 0 || std::memcmp(executed[r].data(), streamed[r].data(),
                                        count * 4) == 0;
          CHECK_MESSAGE(same, "stream order differs: dims ", dims.size(),
                        "-tier p=", p, " rings=", rings, " count=", count,
                        " rank ", r);
        }
        ++op_id;
      }
}
