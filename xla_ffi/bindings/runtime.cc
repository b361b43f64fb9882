// Bindings: the process-wide state Python reads or ends: operations still
// held, the timeline, split-phase buffers, and the exit sequence.
#include <nanobind/nanobind.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include "cpu/allreduce_handler.h"
#include "cpu/buffer_pool.h"
#include "cpu/gang_start.h"
#include "cpu/inprocess/inprocess_transport.h"
#include "cpu/net/tcp_handshake.h"
#include "cpu/plan/inprocess_plan_host.h"
#include "cpu/split_phase.h"
#include "cpu/timeline.h"
#include "bindings/bindings.h"

namespace nb = nanobind;

void jaxring::bindings::runtime(nb::module_& m) {
  m.def("close_handshakes", &jaxring::close_handshakes, nb::arg("timeout_s"),
        nb::call_guard<nb::gil_scoped_release>(),
        "Refuses TCP handshakes from now on (at exit) and waits for the calls "
        "into OpenSSL in flight; false if some were still running.");
  m.def("wait_for_completions", &jaxring::wait_for_completions,
        nb::arg("timeout_s"), nb::call_guard<nb::gil_scoped_release>(),
        "Waits until no transport thread is completing an XLA future.");
  m.def("timeline_enable", &jaxring::timeline_enable, nb::arg("on"),
        "Starts or stops recording the transport's timeline.");
  m.def("timeline_now_ns", &jaxring::timeline_now_ns,
        "The timeline's clock (steady, ns).");
  m.def(
      "timeline_take",
      []() {
        // (device, run_id, op_id, bytes, rings, begin_ns, end_ns,
        // peers_joined_ns) per event.
        std::vector<std::tuple<int, int64_t, int64_t, int64_t, int, int64_t,
                               int64_t, int64_t>>
            out;
        for (const auto& e : jaxring::timeline_take()) {
          out.emplace_back(e.device, e.run_id, e.op_id, e.bytes, e.rings,
                           e.begin_ns, e.end_ns, e.peers_joined_ns);
        }
        return out;
      },
      "Events recorded since the last call, as tuples.");

  // What the tests check between tests (nothing left pending, buffers
  // pooled); not for jaxring's own use.
  nb::module_ t = m.def_submodule(
      "testing", "Counters of operations still held, for jaxring's tests.");
  t.def(
      "inprocess_pending_ops",
      [] {
        return jaxring::inprocess_pending_ops() +
               jaxring::inprocess_plan_pending_ops();
      },
      "Operations the in-process transport (and its tiered plans' host) still "
      "holds.");
  t.def("gang_start_pending", &jaxring::gang_start_pending,
        "Split-phase starts still gathering their in-process ranks.");
  t.def("split_phase_unfinished_starts",
        &jaxring::split_phase_unfinished_starts,
        "Split-phase allreduces started and not yet finished.");
  t.def("split_phase_pooled_bytes", &jaxring::pooled_bytes,
        "Bytes of released split-phase buffers kept for reuse.");
}
