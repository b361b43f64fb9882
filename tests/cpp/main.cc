// Stand-alone tests of the ring plan, the reductions and the transports,
// without Python or XLA, so they can run under AddressSanitizer,
// UndefinedBehaviorSanitizer and ThreadSanitizer (tests/test_sanitizers.py
// does both builds). They use doctest (Debian/Ubuntu: apt-get install
// doctest-dev). By hand:
//
//   opts="-DJAXRING_BUILD_PYTHON=OFF -DJAXRING_BUILD_CORE_TESTS=ON"
//   cmake -S . -B build-san -G Ninja $opts -DJAXRING_SANITIZE=address,undefined
//   cmake --build build-san && ./build-san/jaxring_core_tests
//
// (and the same with -DJAXRING_SANITIZE=thread, or without sanitizers;
// -DDOCTEST_INCLUDE_DIR=... names doctest's folder where CMake does not find
// it). doctest's options work as usual: --test-case='*TCP*' runs only the
// matching test cases, --list-test-cases lists them, --duration=true times
// each. Each device is a thread, as XLA's virtual CPU devices are; the TCP
// transport and direct allreduce across processes run in forked processes.
//
// Why phases: the tests run in three doctest runs, in this order, each
// applying the command line too:
//   1. the test suite "before threads": the tests that fork(), while this
//      process has no thread but its main one. A child forked beside other
//      threads inherits the locks they hold with no thread to release them
//      (and ThreadSanitizer ends a child that then starts a thread). The
//      allreduces of the other tests leave worker threads behind, so these
//      come first (fork_child in helpers.cc checks it);
//   2. every other test;
//   3. the test suite "last": what can only happen once, at the end (at
//      exit no TCP handshake may start any more, and that is for good).
// A forked child's assertions count in the child only: it exits non-zero
// when one failed, and the parent checks its exit status.
//
// The last line tells the outcome: "[core tests] all phases passed: N test
// cases, M assertions" only when every phase passed and some test ran.
#define DOCTEST_CONFIG_IMPLEMENT
// No signal handlers of doctest's. It sets them for each test case and puts
// the old ones back after, which would drop jaxring's SIGTERM handler
// (shm_segment.cc: set once per process, chained to the one it finds) that
// the segment exit tests' children end through; and the sanitizers report
// crashes themselves.
#define DOCTEST_CONFIG_NO_POSIX_SIGNALS
#include <doctest/doctest.h>

#include <cctype>
#include <cstring>
#include <iostream>
#include <string>
#include <vector>

#include "helpers.h"

namespace {

// doctest's name of the option in `arg` ("--dt-ts=x" and "-ts=x" give
// "ts"), or "" when arg is no option.
std::string option_name(const std::string& arg) {
  const size_t start = arg.find_first_not_of('-');
  if (start == 0 || start == std::string::npos) return "";
  std::string name = arg.substr(start, arg.find('=') - start);
  if (name.rfind("dt-", 0) == 0) name.erase(0, 3);
  return name;
}

// Whether the command line asks doctest for something other than a run
// (help, a version, a count or a list): then one run with it is all.
bool is_query(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    const std::string name = option_name(argv[i]);
    for (const char* query :
         {"help", "h", "?", "version", "v", "count", "c", "list-test-cases",
          "ltc", "list-test-suites", "lts", "list-reporters", "lr"}) {
      if (name == query && std::strchr(argv[i], '=') == nullptr) return true;
    }
  }
  return false;
}

bool is_suite_filter(const std::string& arg) {
  const std::string name = option_name(arg);
  return (name == "test-suite" || name == "ts") &&
         arg.find('=') != std::string::npos;
}

// doctest's wildcards: * and ?, letters in either case.
bool matches(const char* s, const char* pattern) {
  if (*pattern == '*')
    return matches(s, pattern + 1) || (*s && matches(s + 1, pattern));
  if (!*s) return !*pattern;
  return (*pattern == '?' ||
          std::tolower(static_cast<unsigned char>(*pattern)) ==
              std::tolower(static_cast<unsigned char>(*s))) &&
         matches(s + 1, pattern + 1);
}

// Whether the --test-suite filters of the command line (if any) pick
// `suite`.
bool suite_picked(const std::vector<std::string>& args, const char* suite) {
  bool any = false;
  for (const std::string& arg : args) {
    if (!is_suite_filter(arg)) continue;
    any = true;
    std::string list = arg.substr(arg.find('=') + 1) + ",";
    for (size_t at = 0, comma; (comma = list.find(',', at)) != list.npos;
         at = comma + 1) {
      if (matches(suite, list.substr(at, comma - at).c_str())) return true;
    }
  }
  return !any;
}

// One phase: the test suite `suite`, or (nullptr) every test outside the
// suites of the first and the last phase. The command line's own
// --test-suite filters would add to a phase's suite rather than narrow it,
// so they only decide whether phases 1 and 3 run at all.
int run_phase(int number, const char* suite, int argc, char** argv) {
  static bool first_run = true;
  const std::vector<std::string> args(argv, argv + argc);
  if (suite && !suite_picked(args, suite)) return 0;
  std::vector<const char*> phase_argv;
  for (const std::string& arg : args) {
    if (!suite || !is_suite_filter(arg)) phase_argv.push_back(arg.c_str());
  }
  std::cout << "[core tests] phase " << number
            << " of 3: " << (suite ? suite : "the other tests") << std::endl;
  doctest::Context context;
  if (suite) {
    context.addFilter("test-suite", suite);
  } else {
    context.addFilter("test-suite-exclude", jaxring_test::kBeforeThreads);
    context.addFilter("test-suite-exclude", jaxring_test::kLast);
  }
  // The tests a phase skips are other phases'.
  context.setOption("no-skipped-summary", true);
  if (!first_run) {
    context.setOption("no-intro", true);
    context.setOption("no-version", true);
  }
  first_run = false;
  context.applyCommandLine(static_cast<int>(phase_argv.size()),
                           phase_argv.data());
  return context.run();
}

}  // namespace

int main(int argc, char** argv) {
  if (is_query(argc, argv)) {
    doctest::Context context(argc, argv);
    return context.run();
  }
  jaxring_test::note_threads_at_start();
  bool failed = false;
  failed |= run_phase(1, jaxring_test::kBeforeThreads, argc, argv) != 0;
  failed |= run_phase(2, nullptr, argc, argv) != 0;
  failed |= run_phase(3, jaxring_test::kLast, argc, argv) != 0;
  const jaxring_test::Tally t = jaxring_test::tally();
  if (failed || t.failed_test_cases > 0 || t.failed_assertions > 0) {
    std::cout << "[core tests] FAILED: " << t.failed_test_cases << " of "
              << t.test_cases << " test cases, " << t.failed_assertions
              << " of " << t.assertions << " assertions" << std::endl;
    return 1;
  }
  if (t.test_cases == 0) {
    std::cout << "[core tests] FAILED: no test case ran" << std::endl;
    return 1;
  }
  std::cout << "[core tests] all phases passed: " << t.test_cases
            << " test cases, " << t.assertions << " assertions" << std::endl;
  return 0;
}
