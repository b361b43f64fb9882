// The emulated link's timeline (link_pacing.h): first come first served per
// booking, but a transfer ready while the link is idle uses a gap that fits
// it; bookings ahead of the real time are kept, and history behind it goes.
#include <cstdint>

#include <doctest/doctest.h>

#include "cpu/inprocess/link_pacing.h"

TEST_CASE("link timeline: bookings in order, a gap that fits is used") {
  jaxring::LinkTimeline link;
  auto book = [&link](int64_t ready, int64_t busy) {
    return link.book(ready, busy, 0);
  };
  CHECK(book(100, 10) == 100);   // [100, 110)
  CHECK(book(100, 10) == 110);   // queued behind it: [110, 120)
  CHECK(book(200, 10) == 200);   // [200, 210), a gap before it
  CHECK(book(105, 50) == 120);   // fits in [120, 200): [120, 170)
  CHECK(book(150, 40) == 210);   // [170, 200) is too short: after
  CHECK(book(170, 30) == 170);   // exactly fills the gap
  CHECK(book(0, 0) == 0);        // an empty unit on an idle link
  CHECK(book(100, 0) == 250);    // ... and on a busy one waits
  CHECK(link.intervals() == 1);  // [100, 250): joined as they touched
  CHECK(book(250, 5) == 250);
}

TEST_CASE("link timeline: bookings ahead are kept, old history goes") {
  // Bookings run ahead of the real time (an operation is booked whole):
  // nothing still ahead of it is forgotten, however far ahead others go.
  const int64_t s = 1'000'000'000;
  jaxring::LinkTimeline ahead;
  CHECK(ahead.book(0, 10, 0) == 0);
  CHECK(ahead.book(3 * s, 10, 0) == 3 * s);
  CHECK(ahead.book(0, 10, 0) == 10);  // [0, 10) is still known
  // Once the real time is past the history, old intervals go, and a
  // transfer ready before the horizon counts as ready at it.
  CHECK(ahead.book(0, 10, 4 * s) == 4 * s - jaxring::LinkTimeline::kHistoryNs);
  CHECK(ahead.intervals() == 2);
}
