// What each way out of a shared-memory segment's creator leaves in
// /dev/shm (shm_segment.h): SIGTERM and exit() remove the host segment and
// the link's ring; a creator killed outright leaves them, until the next
// job's sweep finds the creator gone; a live creator's segments, and a file
// that is no segment of this build, stay. Forks: test suite "before
// threads".
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <string>
#include <vector>

#include <doctest/doctest.h>

#include "cpu/direct/host_segment.h"
#include "cpu/net/shm_link.h"
#include "cpu/shm_segment.h"
#include "helpers.h"

namespace {

bool in_dev_shm(const std::string& name) {
  return ::access(("/dev/shm" + name).c_str(), F_OK) == 0;
}

// Forks a child that makes a host segment and a link's ring of `job`,
// writes their names on a pipe, and then runs `then` (which must not
// return). *names gets the two names; returns the child's pid.
pid_t fork_creator(const std::string& job, std::vector<std::string>* names,
                   void (*then)(int fd)) {
  int fds[2];
  if (::pipe(fds) != 0) return -1;
  const pid_t pid = jaxring_test::fork_child([&]() -> int {
    ::close(fds[0]);
    std::string error;
    auto seg = jaxring::HostSegment::create(job, 0, 2, 2, &error);
    auto ring = jaxring::ShmRing::create(job, 0, 1, 0, &error);
    const jaxring::ShmOffer offer = ring ? ring->offer() : jaxring::ShmOffer{};
    const std::string text = (seg ? seg->name() : "") + "\n" +
                             std::string(offer.name, offer.name_bytes) + "\n";
    if (::write(fds[1], text.data(), text.size()) !=
        static_cast<ssize_t>(text.size())) {
      _exit(2);
    }
    // seg and ring are never destroyed: nothing unlinks them here.
    then(fds[1]);
    _exit(4);
  });
  ::close(fds[1]);
  std::string text;
  char buf[512];
  ssize_t n;
  while (std::count(text.begin(), text.end(), '\n') < 2 &&
         (n = ::read(fds[0], buf, sizeof buf)) > 0) {
    text.append(buf, static_cast<size_t>(n));
  }
  ::close(fds[0]);
  const size_t nl = text.find('\n');
  names->push_back(text.substr(0, nl));
  names->push_back(nl == std::string::npos
                       ? ""
                       : text.substr(nl + 1, text.find('\n', nl + 1) - nl - 1));
  return pid;
}

int reap(pid_t pid) {
  int status = 0;
  return ::waitpid(pid, &status, 0) == pid ? status : -1;
}

}  // namespace

TEST_SUITE(jaxring_test::kBeforeThreads) {
  // SIGTERM with its default action: the handler removes the names, then
  // the process ends by the signal as it would have.
  TEST_CASE("segments at exit: SIGTERM removes them, then ends the process") {
    std::vector<std::string> names;
    const pid_t pid = fork_creator("core-tests-sigterm", &names, [](int) {
      ::raise(SIGTERM);
      _exit(3);
    });
    const int status = reap(pid);
    CHECK_MESSAGE((WIFSIGNALED(status) && WTERMSIG(status) == SIGTERM),
                  "wait status ", status);
    CHECK((names.size() == 2 && !names[0].empty() && !names[1].empty()));
    for (const auto& name : names) CHECK(!in_dev_shm(name));
  }

  TEST_CASE("segments at exit: exit() removes them") {
    // exit() without destroying either segment: the atexit handler removes
    // them.
    std::vector<std::string> names;
    const pid_t pid =
        fork_creator("core-tests-exit", &names, [](int) { std::exit(0); });
    const int status = reap(pid);
    CHECK_MESSAGE((WIFEXITED(status) && WEXITSTATUS(status) == 0),
                  "wait status ", status);
    for (const auto& name : names) CHECK(!in_dev_shm(name));
  }

  TEST_CASE("segments at exit: the sweep removes only a dead creator's") {
    const std::vector<jaxring::SegmentReader> readers = {
        jaxring::HostSegment::read_creator, jaxring::ShmRing::read_creator};
    // Killed outright (_exit runs no handler, like SIGKILL): both stay, until
    // a sweep finds their creator gone. A live creator's segments, and a
    // file of this user that is not a segment of this build, stay.
    std::vector<std::string> dead, live;
    const pid_t dead_pid =
        fork_creator("core-tests-dead", &dead, [](int) { _exit(0); });
    reap(dead_pid);  // reaped: a zombie's pid still answers kill(pid, 0)
    for (const auto& name : dead) CHECK(in_dev_shm(name));
    const pid_t live_pid = fork_creator("core-tests-live", &live, [](int) {
      for (;;) ::pause();  // until the SIGTERM below
    });
    const std::string foreign = "/jaxring-core-tests-foreign";
    const int fd = ::shm_open(foreign.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    CHECK((fd >= 0 && ::ftruncate(fd, 1 << 16) == 0));
    if (fd >= 0) ::close(fd);
    const std::vector<std::string> removed =
        jaxring::remove_stale_segments(readers);
    auto was_removed = [&](const std::string& name) {
      return std::find(removed.begin(), removed.end(), name) != removed.end();
    };
    for (const auto& name : dead)
      CHECK((was_removed(name) && !in_dev_shm(name)));
    for (const auto& name : live)
      CHECK((!was_removed(name) && in_dev_shm(name)));
    CHECK((!was_removed(foreign) && in_dev_shm(foreign)));
    ::shm_unlink(foreign.c_str());
    // The live creator's names go with it.
    ::kill(live_pid, SIGTERM);
    const int status = reap(live_pid);
    CHECK_MESSAGE((WIFSIGNALED(status) && WTERMSIG(status) == SIGTERM),
                  "wait status ", status);
    for (const auto& name : live) CHECK(!in_dev_shm(name));
  }
}
