// The core tests' shared helpers (helpers.h), and the doctest listener that
// counts their assertions across main.cc's phases and in forked children.
#include "helpers.h"

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <exception>
#include <fstream>
#include <iostream>
#include <optional>
#include <random>
#include <thread>

#include <doctest/doctest.h>

#include "cpu/dispatch.h"

namespace jaxring_test {

namespace {

std::atomic<int64_t> g_test_cases{0}, g_failed_test_cases{0}, g_assertions{0},
    g_failed_assertions{0};

// Counts failed assertions as they happen (a forked child reads its own
// count before it exits) and adds up each run's totals at its end.
class TallyListener : public doctest::IReporter {
 public:
  explicit TallyListener(const doctest::ContextOptions&) {}
  void report_query(const doctest::QueryData&) override {}
  void test_run_start() override {}
  void test_run_end(const doctest::TestRunStats& stats) override {
    g_test_cases += stats.numTestCasesPassingFilters;
    g_failed_test_cases += stats.numTestCasesFailed;
    g_assertions += stats.numAsserts;
  }
  void test_case_start(const doctest::TestCaseData&) override {}
  void test_case_reenter(const doctest::TestCaseData&) override {}
  void test_case_end(const doctest::CurrentTestCaseStats&) override {}
  void test_case_exception(const doctest::TestCaseException&) override {}
  void subcase_start(const doctest::SubcaseSignature&) override {}
  void subcase_end() override {}
  void log_assert(const doctest::AssertData& a) override {
    if (a.m_failed) ++g_failed_assertions;
  }
  void log_message(const doctest::MessageData&) override {}
  void test_case_skipped(const doctest::TestCaseData&) override {}
};

REGISTER_LISTENER("tally", 1, TallyListener);

int g_threads_at_start = 0;

}  // namespace

Tally tally() {
  Tally t;
  t.test_cases = g_test_cases;
  t.failed_test_cases = g_failed_test_cases;
  t.assertions = g_assertions;
  t.failed_assertions = g_failed_assertions;
  return t;
}

std::vector<std::string> run_ranks(const std::vector<int>& order,
                                   const jaxring::OpKey& key,
                                   const jaxring::OpDesc& desc,
                                   const std::vector<const void*>& in,
                                   const std::vector<void*>& out,
                                   double timeout_s) {
  Done done;
  done.remaining = static_cast<int>(order.size());
  std::vector<std::thread> threads;
  for (int r : order) {
    threads.emplace_back([&, r] {
      jaxring::cpu_allreduce(key, desc, r, /*device=*/r,
                             /*process_of_rank=*/{}, in[r], out[r], timeout_s,
                             [&](const std::optional<std::string>& err) {
                               std::lock_guard<std::mutex> lock(done.mu);
                               if (err) done.errors.push_back(*err);
                               if (--done.remaining == 0) done.cv.notify_all();
                             });
    });
  }
  for (auto& t : threads) t.join();
  std::unique_lock<std::mutex> lock(done.mu);
  done.cv.wait(lock, [&] { return done.remaining == 0; });
  return done.errors;
}

std::vector<std::vector<float>> float_allreduce(
    int p, int64_t count, const jaxring::OpDesc& base, int64_t op_id,
    double timeout_s, std::vector<std::string>* errors, double* wall_s) {
  std::vector<std::vector<float>> in(p, std::vector<float>(count));
  std::vector<std::vector<float>> out(p, std::vector<float>(count, -1));
  std::mt19937 gen(static_cast<unsigned>(op_id));
  std::normal_distribution<float> normal(0.f, 1e3f);
  for (auto& v : in)
    for (auto& x : v) x = normal(gen);
  jaxring::OpDesc desc = base;
  desc.type = jaxring::ElemType::kF32;
  desc.count = count;
  desc.world_size = p;
  std::vector<int> order;
  std::vector<const void*> ins;
  std::vector<void*> outs;
  for (int r = 0; r < p; ++r) {
    order.push_back(p - 1 - r);
    ins.push_back(in[r].data());
    outs.push_back(out[r].data());
  }
  const auto t0 = std::chrono::steady_clock::now();
  *errors =
      run_ranks(order, jaxring::OpKey{3, op_id, 0}, desc, ins, outs, timeout_s);
  *wall_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0)
                .count();
  return out;
}

jaxring::JobIdentity test_job(int me) {
  jaxring::JobIdentity id;
  id.process = me;
  id.processes = 2;
  id.secret = "core-test secret, 32 bytes long.";
  id.job_id = "core-test job 01";
  return id;
}

int thread_count() {
  std::ifstream status("/proc/self/status");
  std::string word;
  while (status >> word) {
    if (word == "Threads:") {
      int n = 0;
      status >> n;
      return n;
    }
  }
  return 0;
}

void note_threads_at_start() { g_threads_at_start = thread_count(); }

pid_t fork_child(const std::function<int()>& body) {
  const int threads = thread_count();
  REQUIRE_MESSAGE(threads == g_threads_at_start, "fork() with ", threads,
                  " threads, where the process began with ", g_threads_at_start,
                  ": a test that forks belongs in the test suite \"",
                  kBeforeThreads, "\" (see main.cc)");
  // Whatever waits in the output buffers now would be written twice: by
  // this process and by the child.
  std::cout.flush();
  std::fflush(nullptr);
  const pid_t pid = fork();
  if (pid != 0) return pid;
  const int64_t failed_before = tally().failed_assertions;
  int code = 1;
  try {
    code = body();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "forked child %d: %s\n", ::getpid(), e.what());
  } catch (...) {
    // A REQUIRE that failed: doctest has reported and counted it.
  }
  if (code == 0 && tally().failed_assertions != failed_before) code = 1;
  std::cout.flush();
  std::fflush(nullptr);
  _exit(code);
}

}  // namespace jaxring_test
