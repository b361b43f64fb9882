// At exit no TCP handshake may start (libcrypto frees its state in an
// atexit handler), on either side: once close_handshakes() has run, no proof
// is computed and both ends of a handshake refuse, saying why. This is for
// good in the process, so it runs last: test suite "last".
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <string>

#include <doctest/doctest.h>

#include "cpu/net/tcp_handshake.h"
#include "helpers.h"

TEST_SUITE(jaxring_test::kLast) {
  TEST_CASE("at exit no handshake may start, on either side") {
    const jaxring::JobIdentity job = jaxring_test::test_job(0);
    CHECK(!jaxring::handshake_mac(job, true, "n", "m", 0, 1, 0).empty());
    CHECK((jaxring::close_handshakes(1.0) && jaxring::handshakes_closed()));
    CHECK(jaxring::handshake_mac(job, true, "n", "m", 0, 1, 0).empty());
    int fds[2];
    CHECK(socketpair(AF_UNIX, SOCK_STREAM, 0, fds) == 0);
    std::string error;
    const auto deadline =
        std::chrono::steady_clock::now() + std::chrono::seconds(1);
    CHECK(!jaxring::connect_handshake(fds[0], job, 1, 0, deadline, &error));
    CHECK(error.find("exiting") != std::string::npos);
    int process = -1, channel = -1;
    CHECK(!jaxring::accept_handshake(fds[1], job, deadline, &process, &channel,
                                     &error));
    close(fds[0]);
    close(fds[1]);
  }
}
