// The clock every wait of the CPU executors is measured on, and the periods
// their workers share.
#pragma once

#include <chrono>

namespace jaxring {

using Clock = std::chrono::steady_clock;

// An idle worker rechecks its deadlines (and a direct rank its peers' pids)
// this often.
constexpr auto kDeadlinePoll = std::chrono::milliseconds(20);
// How long a rank must have waited without progress before it looks for a
// peer at the same call site in another program (and how often it looks
// again). A peer merely ahead, in the next program, is the normal case.
constexpr auto kMismatchProbeAfter = std::chrono::seconds(1);

inline Clock::time_point after_seconds(double s) {
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(
                            std::chrono::duration<double>(s));
}

}  // namespace jaxring
