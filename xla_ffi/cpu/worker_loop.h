// The loop every CPU executor's worker thread runs: take the new tasks,
// give each active task one pass, drop those that finished, and sleep when
// no pass moved anything, until something may have changed or a deadline
// needs checking. What "new tasks" and "sleep" are differs by executor (a
// TaskQueue in one process, the host segment's doorbell across processes);
// the loop is this one.
#pragma once

#include <iterator>
#include <list>

namespace jaxring {

// collect(active) -> Epoch: moves the new tasks into `active` (blocking
//   while there are none, where it can) and returns what idle compares
//   against to tell whether anything happened since.
// advance(task, &finished) -> bool: one pass over the task; whether it
//   moved anything. Sets finished once the task's completion has run.
// idle(epoch, active): sleeps until the epoch moves or the deadline poll;
//   called after a pass that moved nothing, with `active` possibly empty.
template <typename Task, typename Collect, typename Advance, typename Idle>
[[noreturn]] void run_worker_loop(Collect collect, Advance advance, Idle idle) {
  std::list<Task> active;
  for (;;) {
    const auto seen = collect(active);
    bool progressed = false;
    for (auto it = active.begin(); it != active.end();) {
      bool finished = false;
      progressed |= advance(*it, &finished);
      it = finished ? active.erase(it) : std::next(it);
    }
    if (!progressed) idle(seen, active);
  }
}

}  // namespace jaxring
