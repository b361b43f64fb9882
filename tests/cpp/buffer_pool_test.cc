// The buffer pool (buffer_pool.h): a released buffer comes back for the next
// request of its size, and the pool never holds more than its cap.
#include <cstddef>
#include <cstdint>
#include <cstring>

#include <doctest/doctest.h>

#include "cpu/buffer_pool.h"

TEST_CASE("buffer pool: a released buffer comes back; the cap holds") {
  const int64_t before = jaxring::pooled_bytes();
  const void* first = nullptr;  // (a char* would print as a string)
  {
    jaxring::PooledBuffer a = jaxring::acquire_buffer(12345);
    first = a.get();
    std::memset(a.get(), 1, 12345);
  }
  CHECK(jaxring::pooled_bytes() == before + 12345);
  {
    jaxring::PooledBuffer b = jaxring::acquire_buffer(12345);
    CHECK(static_cast<const void*>(b.get()) == first);
    CHECK(jaxring::pooled_bytes() == before);
    jaxring::PooledBuffer c = jaxring::acquire_buffer(12345);
    CHECK(static_cast<const void*>(c.get()) != first);
  }
  CHECK(jaxring::pooled_bytes() == before + 2 * 12345);
  {
    const size_t huge = static_cast<size_t>(jaxring::kMaxPooledBytes);
    jaxring::PooledBuffer d = jaxring::acquire_buffer(huge);
  }
  CHECK(jaxring::pooled_bytes() == before + 2 * 12345);
}
