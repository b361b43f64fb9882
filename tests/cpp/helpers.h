// What several of the core tests share: running one allreduce with a thread
// per rank, the job identity of the two-process tests, forking a child
// process safely, and the test suites that main.cc runs in phases.
#pragma once

#include <sys/types.h>

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include "cpu/net/tcp_handshake.h"
#include "cpu/operation.h"

namespace jaxring_test {

// The test suites that main.cc runs before and after all the others. Tests
// that fork() go in kBeforeThreads, which runs while this process has no
// thread but its main one; kLast holds what may only happen once nothing
// else runs any more.
constexpr char kBeforeThreads[] = "before threads";
constexpr char kLast[] = "last";

// Where the ranks of one operation report their completion.
struct Done {
  std::mutex mu;
  std::condition_variable cv;
  int remaining;
  std::vector<std::string> errors;
};

// Starts one allreduce with a thread per rank, in `order`, and waits until
// every rank's completion has run; returns the errors they reported.
std::vector<std::string> run_ranks(const std::vector<int>& order,
                                   const jaxring::OpKey& key,
                                   const jaxring::OpDesc& desc,
                                   const std::vector<const void*>& in,
                                   const std::vector<void*>& out,
                                   double timeout_s);

// One float allreduce among p ranks started from their own threads; returns
// every rank's output and the wall time, and fills *errors.
std::vector<std::vector<float>> float_allreduce(
    int p, int64_t count, const jaxring::OpDesc& base, int64_t op_id,
    double timeout_s, std::vector<std::string>* errors, double* wall_s);

// The job of the two-process TCP tests, as process `me` holds it.
jaxring::JobIdentity test_job(int me);

// The number of threads this process has now.
int thread_count();

// Records how many threads the process has before any test runs (main.cc
// calls it first); fork_child compares against it.
void note_threads_at_start();

// Forks a child process that runs `body` and exits with what it returns,
// made 1 if a doctest assertion failed in the child or body threw (a
// child's assertions are counted in the child only: the parent learns of
// them through the exit status, which it must check). Fails the calling
// test (REQUIRE) unless the process still has only the threads it started
// with: a child forked beside other threads inherits the locks they hold,
// with no thread to release them. Returns the child's pid (-1 when fork
// failed).
pid_t fork_child(const std::function<int()>& body);

// Counts over every doctest run of this process so far (main.cc's phases
// are several runs), kept by a doctest listener: failed assertions as they
// happen, the others at the end of each run.
struct Tally {
  int64_t test_cases = 0;  // that ran
  int64_t failed_test_cases = 0;
  int64_t assertions = 0;
  int64_t failed_assertions = 0;
};
Tally tally();

}  // namespace jaxring_test
