// Direct allreduce across the processes of one host, over the host segment
// (host_direct.h, host_segment.h): two forked processes sum buffers of many
// sizes, many operations at once, several ranks per process and one key
// many times in a row; ranks that disagree fail, both saying so; a peer that
// rewrites the segment's sizes changes nothing, and one that exits is named
// long before the timeout. And a segment laid out by another build is
// refused, naming both layouts. These fork, or ran before any thread did:
// test suite "before threads".
#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <future>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <doctest/doctest.h>

#include "cpu/direct/host_direct.h"
#include "cpu/direct/host_segment.h"
#include "helpers.h"

namespace {

// One rank of a direct allreduce across processes over the host segment:
// waits for its completion (at most 60 s) and returns its error, or "".
std::string host_direct_sum(int rank, int64_t op_id,
                            const std::vector<float>& in,
                            std::vector<float>* out, double timeout_s,
                            const std::vector<int>& process_of_rank = {0, 1}) {
  jaxring::OpDesc d;
  d.type = jaxring::ElemType::kF32;
  d.count = static_cast<int64_t>(in.size());
  d.world_size = static_cast<int>(process_of_rank.size());
  d.algorithm = jaxring::Algorithm::kDirect;
  d.slot_id = op_id;
  auto done = std::make_shared<std::promise<std::string>>();
  std::future<std::string> result = done->get_future();
  jaxring::host_direct_allreduce(
      jaxring::OpKey{1, op_id, 0}, d, rank, process_of_rank, in.data(),
      out->data(), timeout_s, [done](const std::optional<std::string>& e) {
        done->set_value(e ? *e : "");
      });
  if (result.wait_for(std::chrono::seconds(60)) != std::future_status::ready) {
    return "no completion within 60 s";
  }
  return result.get();
}

// Process `me` of two, in the host segment `shared` (process 0's, inherited
// through fork; process 1 maps it by name, as a peer does). Runs in a
// forked child: a failed assertion makes its exit status non-zero
// (fork_child).
int host_direct_process(int me, std::unique_ptr<jaxring::HostSegment> shared,
                        const std::string& job) {
  std::string error;
  std::unique_ptr<jaxring::HostSegment> seg =
      me == 0 ? std::move(shared)
              : jaxring::HostSegment::open(shared->name(), job, 1, &error);
  if (me == 1)
    (void)shared.release();  // process 0's object: not this one's to unmap
  REQUIRE(seg != nullptr);
  while (seg->mapped() < 2)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  if (me == 0) seg->unlink();
  seg->watch_peers(me);
  // The header, to rewrite it as a broken peer would (its sizes sit at
  // bytes 20 and 24, before the entries at 8 KiB).
  char* header = reinterpret_cast<char*>(&seg->entry(0)) - 8192;
  jaxring::set_host_segment(std::move(seg), me, "");
  auto pattern = [](int64_t i) { return static_cast<float>(i % 7 + 1); };
  auto check_sum = [&](int64_t op_id, int64_t count) {
    std::vector<float> in(count), out(count, -1.0f);
    for (int64_t i = 0; i < count; ++i) in[i] = (me + 1) * pattern(i);
    const std::string e = host_direct_sum(me, op_id, in, &out, 30.0);
    CHECK(e.empty());
    for (int64_t i = 0; i < count; ++i) {
      if (out[i] != 3 * pattern(i)) {
        CHECK(out[i] == 3 * pattern(i));
        break;
      }
    }
  };
  // Empty, short, and more than one 1 MiB chunk.
  for (int64_t count : {0, 1, 1000, 300001}) check_sum(10 + count % 97, count);
  // 12 operations in flight at once over 8 entries, started in opposite
  // orders: those that share an entry take turns, none waits for ever.
  {
    std::vector<std::thread> ops;
    for (int k = 0; k < 12; ++k) {
      const int64_t op = me == 0 ? 100 + k : 111 - k;
      ops.emplace_back([&, op] { check_sum(op, 5000 + op); });
    }
    for (auto& t : ops) t.join();
  }
  // Two ranks in each process, each served by a worker thread of its own,
  // several operations at once: every rank gets the sum of all four.
  {
    std::vector<std::thread> ops;
    for (int local = 0; local < 2; ++local) {
      for (int k = 0; k < 3; ++k) {
        ops.emplace_back([&, local, k] {
          const int rank = 2 * me + local;
          const int64_t count = 100000 + 1000 * k;
          std::vector<float> in(count), out(count, -1.0f);
          for (int64_t i = 0; i < count; ++i) in[i] = (rank + 1) * pattern(i);
          CHECK(host_direct_sum(rank, 200 + k, in, &out, 30.0, {0, 0, 1, 1})
                    .empty());
          for (int64_t i = 0; i < count; ++i) {
            if (out[i] != 10 * pattern(i)) {
              CHECK(out[i] == 10 * pattern(i));
              break;
            }
          }
        });
      }
    }
    for (auto& t : ops) t.join();
  }
  // One key many times in a row, as an allreduce in a loop's body runs in
  // one run: a rank done with one time starts the next while its peer may
  // still copy the last one's result out. Each time sums its own inputs.
  for (int64_t count : {1000, 300001, 0}) {
    for (int k = 0; k < 40; ++k) {
      std::vector<float> in(count), out(count, -1.0f);
      for (int64_t i = 0; i < count; ++i)
        in[i] = (me + 1) * (k + 1) * pattern(i);
      CHECK(host_direct_sum(me, 600 + count % 7, in, &out, 30.0).empty());
      for (int64_t i = 0; i < count; ++i) {
        if (out[i] != 3 * (k + 1) * pattern(i)) {
          CHECK(out[i] == 3 * (k + 1) * pattern(i));
          break;
        }
      }
    }
  }
  // Ranks that disagree on the count fail, both, saying so.
  {
    std::vector<float> in(me == 0 ? 100 : 200, 1.0f), out(in.size());
    const std::string e = host_direct_sum(me, 300, in, &out, 30.0);
    CHECK(e.find("kind=mismatch") != std::string::npos);
    CHECK((e.find("100 x float32") != std::string::npos &&
           e.find("200 x float32") != std::string::npos));
  }
  // A peer that rewrites the segment's sizes changes nothing here.
  if (me == 1) {
    reinterpret_cast<std::atomic<int32_t>*>(header + 20)->store(1 << 20);
    reinterpret_cast<std::atomic<int32_t>*>(header + 24)->store(1 << 20);
  }
  check_sum(400, 300001);
  // A peer that exits is named, long before the timeout.
  if (me == 1) return 0;
  std::vector<float> in(1000, 1.0f), out(1000);
  const auto start = std::chrono::steady_clock::now();
  const std::string e = host_direct_sum(me, 500, in, &out, 20.0);
  CHECK(e.find("kind=peer_lost peer=1") != std::string::npos);
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(5));
  CHECK(jaxring::host_direct_pending() == 0);
  return 0;
}

}  // namespace

TEST_SUITE(jaxring_test::kBeforeThreads) {
  // Two forked processes of a direct allreduce over one host segment.
  TEST_CASE("host direct: two forked processes over one host segment") {
    const std::string job = "core-tests-host-direct";
    std::string error;
    auto seg = jaxring::HostSegment::create(
        job, 0, 2, 4, &error);  // 2 processes, up to 4 ranks
    REQUIRE(seg != nullptr);
    pid_t pids[2];
    for (int me = 0; me < 2; ++me) {
      pids[me] = jaxring_test::fork_child(
          [&, me] { return host_direct_process(me, std::move(seg), job); });
    }
    for (int me = 0; me < 2; ++me) {
      int status = 0;
      CHECK(waitpid(pids[me], &status, 0) == pids[me]);
      CHECK_MESSAGE((WIFEXITED(status) && WEXITSTATUS(status) == 0), "process ",
                    me, ": wait status ", status);
    }
  }

  // A process of another build opening the host segment: a segment whose
  // first word names another layout version is refused, naming both.
  TEST_CASE("host segment: another build's layout is refused, naming both") {
    const std::string job = "core-tests-host-layout";
    std::string error;
    auto seg = jaxring::HostSegment::create(job, 0, 2, 2, &error);
    REQUIRE(seg != nullptr);
    CHECK(jaxring::HostSegment::open(seg->name(), job, 1, &error) != nullptr);
    const int fd = ::open(("/dev/shm" + seg->name()).c_str(), O_RDWR);
    CHECK(fd >= 0);
    uint64_t magic = 0;
    CHECK(::pread(fd, &magic, sizeof magic, 0) == sizeof magic);
    const uint64_t first_layout =
        (magic & ~uint64_t{0xffff}) | 0x5347;  // "...SG"
    CHECK(::pwrite(fd, &first_layout, sizeof first_layout, 0) ==
          sizeof first_layout);
    ::close(fd);
    error.clear();
    CHECK(jaxring::HostSegment::open(seg->name(), job, 1, &error) == nullptr);
    CHECK(error.find("layout version 1 and this jaxring build lays it out as "
                     "version") != std::string::npos);
    CHECK(error.find("same jaxring build") != std::string::npos);
  }
}
