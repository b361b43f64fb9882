// Allreduces among the threads of one process (each thread a device, as
// XLA's virtual CPU devices are): the ring and the direct algorithm, into
// separate outputs and in place, several at once, under link emulation, and
// with a rank that never arrives. Integer sums are checked exactly; link
// emulation must give the threaded ring's float bits and take the link's
// time.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <doctest/doctest.h>

#include "cpu/inprocess/inprocess_transport.h"
#include "helpers.h"

namespace {

using jaxring_test::float_allreduce;
using jaxring_test::run_ranks;

// The ring, direct and emulated allreduces below take their ids (which also
// seed their start order) from this one count, in the file's order.
int64_t g_op_id = 1;

// Runs one allreduce of `count` int32 values among p "devices", each
// started from its own thread in a shuffled order, and checks the sums.
// in_place: every rank's output is its input buffer (as when XLA aliases
// them).
void run_allreduce(int p, int rings, int64_t count, int64_t chunk_bytes,
                   int64_t op_id, unsigned seed,
                   jaxring::Algorithm algorithm = jaxring::Algorithm::kRing,
                   bool in_place = false, double link_bytes_per_s = 0) {
  INFO("p=", p, " rings=", rings, " count=", count, " chunk=", chunk_bytes,
       " op_id=", op_id, " algorithm=", static_cast<int>(algorithm),
       " in_place=", in_place, " link=", link_bytes_per_s);
  std::vector<std::vector<int32_t>> in(p, std::vector<int32_t>(count));
  std::vector<std::vector<int32_t>> out(p, std::vector<int32_t>(count, -1));
  std::vector<int64_t> expect(count, 0);
  for (int r = 0; r < p; ++r)
    for (int64_t i = 0; i < count; ++i) {
      in[r][i] = static_cast<int32_t>((r + 1) * 7 + i % 13);
      expect[i] += in[r][i];
    }
  jaxring::OpDesc desc;
  desc.type = jaxring::ElemType::kS32;
  desc.op = jaxring::ReduceOp::kSum;
  desc.count = count;
  desc.world_size = p;
  desc.num_rings = rings;
  desc.chunk_bytes = chunk_bytes;
  desc.algorithm = algorithm;
  if (link_bytes_per_s > 0) desc.link = {{p, link_bytes_per_s, 2e-6}};
  std::vector<int> order(p);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), std::mt19937(seed));
  std::vector<const void*> ins;
  std::vector<void*> outs;
  for (int r = 0; r < p; ++r) {
    ins.push_back(in[r].data());
    outs.push_back(in_place ? in[r].data() : out[r].data());
  }
  CHECK(run_ranks(order, jaxring::OpKey{1, op_id, 0}, desc, ins, outs, 30.0)
            .empty());
  // Asserted only where an element is wrong: millions of passing doctest
  // assertions would cost more than the allreduces (under TSan most).
  for (int r = 0; r < p; ++r)
    for (int64_t i = 0; i < count; ++i)
      if ((in_place ? in : out)[r][i] != static_cast<int32_t>(expect[i])) {
        CHECK((in_place ? in : out)[r][i] == static_cast<int32_t>(expect[i]));
      }
}

}  // namespace

TEST_CASE("ring allreduce: exact sums for every size, ring count and chunk") {
  for (int p : {2, 3, 5, 8})
    for (int rings : {1, 2, 3})
      for (int64_t count : {0, 1, 17, 1000, 100003})
        for (int64_t chunk : {4, 256, 1 << 20}) {
          if (chunk == 4 && count > 1000) continue;  // keeps TSan quick
          const int id = g_op_id++;
          run_allreduce(p, rings, count, chunk, id, static_cast<unsigned>(id));
        }
}

TEST_CASE("direct allreduce: into separate outputs and in place") {
  for (int p : {2, 3, 5, 8})
    for (int64_t count : {0, 1, 17, 1000, 100003})
      for (bool in_place : {false, true}) {
        const int id = g_op_id++;
        run_allreduce(p, 2, count, 1 << 20, id, static_cast<unsigned>(id),
                      jaxring::Algorithm::kDirect, in_place);
      }
}

TEST_CASE("several allreduces at once, started in different orders") {
  std::vector<std::thread> ops;
  for (int k = 0; k < 6; ++k)
    ops.emplace_back([k] {
      run_allreduce(
          4, 2, 5000 + k, 512, 1000 + k, k,
          k % 2 ? jaxring::Algorithm::kDirect : jaxring::Algorithm::kRing);
    });
  for (auto& t : ops) t.join();
}

TEST_CASE("link emulation, ints: exact sums, separate outputs and in place") {
  for (int p : {2, 3, 8})
    for (int64_t count : {0, 1, 17, 100003})
      for (bool in_place : {false, true}) {
        const int id = g_op_id++;
        run_allreduce(p, 2, count, 4096, id, static_cast<unsigned>(id),
                      jaxring::Algorithm::kRing, in_place, /*link=*/10e9);
      }
}

// Link emulation moves the data on one thread in the plan's order: the
// floats must be the threaded ring's, bit for bit; the operation takes at
// least the link's time; and a link too slow for the timeout is an error
// that names the ranks, with no buffer touched after it.
TEST_CASE("link emulation: the threaded ring's bits, the link's time") {
  const int p = 5;
  const int64_t count = 40000;  // 160 KB per rank
  for (int rings : {1, 3})
    for (int64_t chunk : {int64_t{4096}, int64_t{1} << 20}) {
      jaxring::OpDesc desc;
      desc.num_rings = rings;
      desc.chunk_bytes = chunk;
      std::vector<std::string> errors;
      double wall = 0;
      const auto threaded =
          float_allreduce(p, count, desc, 10 + rings, 30, &errors, &wall);
      CHECK(errors.empty());
      desc.link = {{p, 200e6, 50e-6}};
      const auto emulated =
          float_allreduce(p, count, desc, 10 + rings, 30, &errors, &wall);
      CHECK(errors.empty());
      for (int r = 0; r < p; ++r) {
        CHECK(std::memcmp(threaded[r].data(), emulated[r].data(), count * 4) ==
              0);
        CHECK(std::memcmp(emulated[0].data(), emulated[r].data(), count * 4) ==
              0);
      }
      // Each rank sends 2(p-1)/p of its buffer over its own link.
      const double link_s =
          2.0 * (p - 1) / p * count * 4 / desc.link[0].bytes_per_s;
      CHECK(wall >= 0.95 * link_s);
    }
}

TEST_CASE("link emulation: 20 MiB per rank in shares, still the ring's bits") {
  // 20 MiB per rank: the data is cut into shares that several workers
  // take at once (see kMinShareBytes); still the ring's bits.
  jaxring::OpDesc desc;
  desc.num_rings = 2;
  desc.chunk_bytes = 256 << 10;
  std::vector<std::string> errors;
  double wall = 0;
  const int64_t big = 5 << 20;
  const auto threaded = float_allreduce(3, big, desc, 30, 60, &errors, &wall);
  CHECK(errors.empty());
  desc.link = {{3, 1e11, 0}};
  const auto emulated = float_allreduce(3, big, desc, 30, 60, &errors, &wall);
  CHECK(errors.empty());
  for (int r = 0; r < 3; ++r) {
    CHECK(std::memcmp(threaded[r].data(), emulated[r].data(), big * 4) == 0);
  }
}

TEST_CASE("link emulation: a later allreduce uses the gaps between bookings") {
  // An allreduce started while another's transfers are booked on the same
  // links goes in their gaps. The first here waits 250 ms for each of its
  // 4 steps and sends almost nothing: its links idle. The second (1 ms
  // per step) must not wait for the first's last step, as it would if
  // bookings were only appended.
  jaxring::OpDesc slow, quick;
  slow.link = {{3, 1e9, 0.25}};
  quick.link = {{3, 1e9, 1e-3}};
  std::vector<std::string> slow_errors, quick_errors;
  double slow_wall = 0, quick_wall = 0;
  std::thread first(
      [&] { float_allreduce(3, 30, slow, 40, 60, &slow_errors, &slow_wall); });
  std::this_thread::sleep_for(std::chrono::milliseconds(150));
  float_allreduce(3, 30, quick, 41, 60, &quick_errors, &quick_wall);
  first.join();
  CHECK((slow_errors.empty() && quick_errors.empty()));
  CHECK(slow_wall > 0.95);
  CHECK(quick_wall < 0.35);
}

TEST_CASE("link emulation: a link too slow for the timeout fails every rank") {
  jaxring::OpDesc desc;
  desc.link = {{3, 1e6, 0}};  // 0.5 s of link for 0.2 s of timeout
  std::vector<std::string> errors;
  double wall = 0;
  float_allreduce(3, 100000, desc, 20, 0.2, &errors, &wall);
  CHECK(errors.size() == 3);
  for (const auto& e : errors)
    CHECK(e.find("did not finish") != std::string::npos);
}

// A rank that never arrives: the others fail after the timeout, naming it
// (the ring, the direct algorithm, the ring under link emulation).
TEST_CASE("a rank that never arrives: the others time out, naming it") {
  for (int kind = 0; kind < 3; ++kind) {
    const auto algorithm =
        kind == 1 ? jaxring::Algorithm::kDirect : jaxring::Algorithm::kRing;
    jaxring::OpDesc desc;
    if (kind == 2) desc.link = {{3, 1e9, 0}};
    desc.type = jaxring::ElemType::kF32;
    desc.count = 10;
    desc.world_size = 3;
    desc.algorithm = algorithm;
    std::vector<float> a(10, 1), b(10, 1), oa(10), ob(10);
    jaxring_test::Done done;
    done.remaining = 2;
    auto cb = [&](const std::optional<std::string>& err) {
      std::lock_guard<std::mutex> lock(done.mu);
      if (err) done.errors.push_back(*err);
      if (--done.remaining == 0) done.cv.notify_all();
    };
    const jaxring::OpKey key{2, 1, kind};
    jaxring::inprocess_allreduce(key, desc, 0, 0, a.data(), oa.data(), 0.3, cb);
    jaxring::inprocess_allreduce(key, desc, 1, 1, b.data(), ob.data(), 0.3, cb);
    std::unique_lock<std::mutex> lock(done.mu);
    done.cv.wait(lock, [&] { return done.remaining == 0; });
    CHECK(done.errors.size() == 2);
    for (const auto& e : done.errors)
      CHECK(e.find("rank(s) 2 of 3 never arrived") != std::string::npos);
  }
}
