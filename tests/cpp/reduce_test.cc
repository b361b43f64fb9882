// The reductions' 16-bit conversions: float16 and bfloat16 to float and
// back give every finite value its own bits again.
#include <cstdint>

#include <doctest/doctest.h>

#include "reduce.h"

TEST_CASE("16-bit conversions round-trip every finite value") {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float f = jaxring::half_to_float(static_cast<uint16_t>(h));
    if (f == f) CHECK(jaxring::float_to_half(f) == h);
    const float b = jaxring::bfloat16_to_float(static_cast<uint16_t>(h));
    if (b == b) CHECK(jaxring::float_to_bfloat16(b) == h);
  }
}
