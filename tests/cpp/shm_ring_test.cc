// The shared-memory ring of a link (shm_link.h) on its own: who may map it,
// what it carries (payloads of many sizes, wrapping many times, come out
// whole), and how a sender waits for room: it gives up when its operation
// is gone and fails when the peer's connection closes. Ran before any
// thread did: test suite "before threads".
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <doctest/doctest.h>

#include "cpu/net/shm_link.h"
#include "helpers.h"

TEST_SUITE(jaxring_test::kBeforeThreads) {
  TEST_CASE("shm ring: who may map it, what it carries, waiting for room") {
    const std::string job_id(16, 'j');
    std::string error;
    auto tx = jaxring::ShmRing::create(job_id, 1, 0, 3, &error);
    REQUIRE_MESSAGE(tx != nullptr, "no shared-memory ring: ", error);
    const jaxring::ShmOffer offer = tx->offer();
    // Only the link it was made for may map it: not the other direction,
    // another ring, or another job.
    CHECK(!jaxring::ShmRing::open(offer, job_id, 0, 1, 3, &error));
    CHECK(!jaxring::ShmRing::open(offer, job_id, 1, 0, 4, &error));
    CHECK(
        !jaxring::ShmRing::open(offer, std::string(16, 'k'), 1, 0, 3, &error));
    jaxring::ShmOffer forged = offer;
    forged.capacity *= 2;
    CHECK(!jaxring::ShmRing::open(forged, job_id, 1, 0, 3, &error));
    auto rx = jaxring::ShmRing::open(offer, job_id, 1, 0, 3, &error);
    REQUIRE(rx != nullptr);
    tx->unlink();
    const std::string name(offer.name, offer.name_bytes);
    CHECK((shm_open(name.c_str(), O_RDONLY, 0) < 0 && errno == ENOENT));
    int fds[2];  // the connection beside the ring
    CHECK(socketpair(AF_UNIX, SOCK_STREAM, 0, fds) == 0);
    const auto always = [] { return true; };
    // Nothing written yet: the receiver refuses to read. (The pointers it
    // returns are compared as void*: doctest would print a char* as text.)
    CHECK(static_cast<const void*>(rx->next(16, &error)) == nullptr);
    CHECK((!tx->carries(0) && !tx->carries(tx->capacity() / 2 + 1)));
    // Payloads of many sizes, wrapping the ring many times, come out whole.
    std::mt19937 rng(7);
    for (int i = 0; i < 300; ++i) {
      const int64_t n = 1 + static_cast<int64_t>(rng() % (tx->capacity() / 2));
      std::vector<char> data(static_cast<size_t>(n), static_cast<char>(i));
      data[0] = 'a';
      data[n - 1] = 'z';
      CHECK(tx->put(data.data(), n, fds[0], 1.0, always, &error) ==
            jaxring::ShmRing::Put::kDone);
      const char* got = rx->next(n, &error);
      CHECK((got != nullptr &&
             std::memcmp(got, data.data(), static_cast<size_t>(n)) == 0));
      rx->release(n);
    }
    // A full ring: the sender gives up when its operation is gone, and fails
    // when the peer's connection closes, without writing.
    const int64_t half = tx->capacity() / 2;
    std::vector<char> big(static_cast<size_t>(half), 1);
    int done = 0;
    jaxring::ShmRing::Put put = jaxring::ShmRing::Put::kDone;
    while (put == jaxring::ShmRing::Put::kDone && done < 4) {
      put =
          tx->put(big.data(), half, fds[0], 1.0, [] { return false; }, &error);
      done += put == jaxring::ShmRing::Put::kDone;
    }
    CHECK((put == jaxring::ShmRing::Put::kGaveUp && done >= 1 && done <= 2));
    close(fds[1]);
    CHECK(tx->put(big.data(), half, fds[0], 5.0, always, &error) ==
          jaxring::ShmRing::Put::kFailed);
    CHECK(error.find("closed") != std::string::npos);
    close(fds[0]);
    // The receiver frees room, and the sender goes on.
    for (int k = 0; k < done; ++k) {
      CHECK(static_cast<const void*>(rx->next(half, &error)) != nullptr);
      rx->release(half);
    }
    CHECK(socketpair(AF_UNIX, SOCK_STREAM, 0, fds) == 0);
    CHECK(tx->put(big.data(), half, fds[0], 1.0, always, &error) ==
          jaxring::ShmRing::Put::kDone);
    close(fds[0]);
    close(fds[1]);
  }
}
