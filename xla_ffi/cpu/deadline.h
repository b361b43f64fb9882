// The clock every wait of the CPU transports is measured on.
#pragma once

#include <chrono>

namespace jaxring {

using Clock = std::chrono::steady_clock;

inline Clock::time_point after_seconds(double s) {
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(
                            std::chrono::duration<double>(s));
}

}  // namespace jaxring
