// Timeline of the in-process transport: when each device's part of each
// operation began and ended, for a Chrome/Perfetto trace. Off by default;
// recording costs one clock read and a locked push per operation and device.
#pragma once

#include <cstdint>
#include <vector>

namespace jaxring {

struct TimelineEvent {
  int device;
  int64_t run_id;
  int64_t op_id;
  int64_t bytes;
  int rings;
  int64_t begin_ns;  // steady clock: the rank joined (its start ran)
  int64_t end_ns;    // the rank's part completed
  // When the operation's last rank joined, where this process runs all of
  // them (else -1): from begin_ns to then, the rank waited for its peers
  // to reach the operation, not for the data to move.
  int64_t peers_joined_ns;
};

void timeline_enable(bool on);
bool timeline_enabled();
void timeline_record(const TimelineEvent& e);
// Returns the events recorded since the last call and forgets them.
std::vector<TimelineEvent> timeline_take();
// The steady clock the events use, in ns (to line them up with host time).
int64_t timeline_now_ns();

}  // namespace jaxring
