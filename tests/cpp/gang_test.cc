// Gang start (gang_start.h): every rank waits for the last; a rank of
// another operation passes while one gathers; a missing rank costs at most
// the wait.
#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#include <doctest/doctest.h>

#include "cpu/gang_start.h"

using Clock = std::chrono::steady_clock;

TEST_CASE("gang start: every rank waits for the last") {
  std::vector<std::thread> ranks;
  std::atomic<int> all{0};
  for (int r = 0; r < 4; ++r)
    ranks.emplace_back(
        [&] { all += jaxring::gang_start_wait({7, 1, 0}, 4, 10.0); });
  for (auto& t : ranks) t.join();
  CHECK(all.load() == 4);
  CHECK(jaxring::gang_start_pending() == 0);
}

TEST_CASE("gang start: another operation's rank passes while one gathers") {
  // Rank 0 of op 2 gathers; a rank of op 3 arrives meanwhile and passes.
  std::atomic<bool> op2_done{false};
  std::thread waiter([&] {
    CHECK(jaxring::gang_start_wait({7, 2, 0}, 2, 10.0));
    op2_done = true;
  });
  while (jaxring::gang_start_pending() == 0) std::this_thread::yield();
  const auto t0 = Clock::now();
  CHECK(!jaxring::gang_start_wait({7, 3, 0}, 2, 10.0));
  CHECK(Clock::now() - t0 < std::chrono::seconds(5));
  CHECK(!op2_done.load());
  CHECK(jaxring::gang_start_wait({7, 2, 0}, 2, 10.0));  // the last arrival
  waiter.join();
  CHECK(op2_done.load());
  // Op 3's second rank finds its first one counted and does not wait.
  CHECK(jaxring::gang_start_wait({7, 3, 0}, 2, 10.0));
  CHECK(jaxring::gang_start_pending() == 0);
}

TEST_CASE("gang start: a rank that never comes costs at most the wait") {
  // A rank that never comes: the wait ends after max_wait_s, unfulfilled.
  const auto t0 = Clock::now();
  CHECK(!jaxring::gang_start_wait({7, 4, 0}, 2, 0.2));
  const auto waited = Clock::now() - t0;
  CHECK(waited >= std::chrono::milliseconds(190));
  CHECK(waited < std::chrono::seconds(5));
}
