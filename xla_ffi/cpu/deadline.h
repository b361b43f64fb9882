// The clock every wait of the CPU executors is measured on, the periods
// their workers share, and the one watch over a wait: when it has run out,
// and when to look for a peer in another program.
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

// When a rank that waits without progress looks for a peer at the same call
// site in another program: once it has waited kMismatchProbeAfter, then
// every kMismatchProbeAfter. The plan executor and direct both ask it.
class MismatchProbe {
 public:
  void progressed(Clock::time_point now) { last_progress_ = now; }
  // Whether to look now; a yes holds the next look off.
  bool due(Clock::time_point now) {
    if (now <= last_progress_ + kMismatchProbeAfter || now <= next_) {
      return false;
    }
    next_ = now + kMismatchProbeAfter;
    return true;
  }

 private:
  Clock::time_point last_progress_ = Clock::now();
  Clock::time_point next_{};
};

// What a worker does about an operation it waits on, after a pass over it.
enum class WaitVerdict { kKeepWaiting, kLookForOtherProgram, kTimedOut };

// The watch every executor applies after each pass over a waiting
// operation (the in-process ring, the plan executor, host-segment direct):
// progress resets the probe; a wait past the deadline times out; a wait
// of kMismatchProbeAfter without progress looks for a peer in another
// program (probe null: all ranks run in this program, so none can be).
// Whom the timeout names, and how a peer in another program is found, are
// each executor's own.
inline WaitVerdict watch_wait(bool progressed, Clock::time_point now,
                              Clock::time_point deadline,
                              MismatchProbe* probe) {
  if (progressed) {
    if (probe != nullptr) probe->progressed(now);
    return WaitVerdict::kKeepWaiting;
  }
  if (now > deadline) return WaitVerdict::kTimedOut;
  if (probe != nullptr && probe->due(now)) {
    return WaitVerdict::kLookForOtherProgram;
  }
  return WaitVerdict::kKeepWaiting;
}

inline Clock::time_point after_seconds(double s) {
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(
                            std::chrono::duration<double>(s));
}

}  // namespace jaxring
