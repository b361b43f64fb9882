// Bindings: the host segment, for algorithm="direct" across the processes of
// one host (set up by jaxring._src.host_segment).
#include <nanobind/nanobind.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <memory>
#include <mutex>

#include "cpu/direct/host_direct.h"
#include "cpu/direct/host_segment.h"
#include "cpu/net/shm_link.h"
#include "bindings/bindings.h"

namespace nb = nanobind;

namespace {

// The host segment between host_segment_attach and host_segment_commit.
std::mutex& pending_segment_mu() {
  static std::mutex* mu = new std::mutex();
  return *mu;
}
std::unique_ptr<jaxring::HostSegment>& pending_segment() {
  static auto* s = new std::unique_ptr<jaxring::HostSegment>();
  return *s;
}

}  // namespace

void jaxring::bindings::host_segment(nb::module_& m) {
  // The host segment, for algorithm="direct" across the processes of one
  // host (set up by jaxring._src.distributed).
  m.def(
      "host_segment_attach",
      [](nb::bytes job_id, int process, int processes, int ranks,
         const std::string& name) {
        std::string error;
        const std::string id(job_id.c_str(), job_id.size());
        std::unique_ptr<jaxring::HostSegment> s =
            name.empty()
                ? jaxring::HostSegment::create(id, process, processes, ranks,
                                               &error)
                : jaxring::HostSegment::open(name, id, process, &error);
        if (!s) throw std::runtime_error(error);
        std::lock_guard<std::mutex> lock(pending_segment_mu());
        pending_segment() = std::move(s);
        return pending_segment()->name();
      },
      nb::arg("job_id"), nb::arg("process"), nb::arg("processes"),
      nb::arg("ranks"), nb::arg("name"),
      "Creates (name '') or maps the host segment; returns its name. It is "
      "used once host_segment_commit says every process of the host has it.");
  m.def(
      "host_segment_commit",
      [](int process, const std::string& missing) {
        std::unique_ptr<jaxring::HostSegment> s;
        {
          std::lock_guard<std::mutex> lock(pending_segment_mu());
          s = std::move(pending_segment());
        }
        if (s) s->unlink();  // every process of the host mapped it, or gave up
        if (s && missing.empty()) s->watch_peers(process);
        jaxring::set_host_segment(
            missing.empty() ? std::move(s) : nullptr, process,
            missing.empty() && !s ? "it was never mapped" : missing);
      },
      nb::arg("process"), nb::arg("missing"),
      "Ends the host segment's set-up: with missing == '' it is used, else "
      "dropped, and missing says why direct across processes is unavailable.");
  m.def(
      "host_segment_unlink",
      [] {
        std::lock_guard<std::mutex> lock(pending_segment_mu());
        if (pending_segment()) pending_segment()->unlink();
      },
      "Removes the name of the host segment being set up, if this process "
      "created it (once every process said whether it mapped it). The "
      "mapping stays.");
  m.def(
      "host_segment_abandon",
      [] {
        std::unique_ptr<jaxring::HostSegment> s;
        {
          std::lock_guard<std::mutex> lock(pending_segment_mu());
          s = std::move(pending_segment());
        }
        // Destroyed here: unlinked where this process created it, and unmapped.
      },
      "Drops the host segment being set up (its set-up was cut short): the "
      "name is removed where this process created it. Committed segments "
      "are not affected.");
  m.def(
      "shm_remove_stale_segments",
      [] {
        return jaxring::remove_stale_segments(
            {jaxring::HostSegment::read_creator,
             jaxring::ShmRing::read_creator});
      },
      "Removes from /dev/shm the host segments and link rings of this user "
      "whose creator (in this pid namespace) is gone; returns their names.");
  m.def(
      "host_segment_info",
      [] {
        nb::dict d;
        jaxring::HostSegment* s = jaxring::host_segment();
        d["available"] = s != nullptr;
        d["missing"] = jaxring::host_segment_missing();
        d["chunk_bytes"] = s ? s->chunk_bytes() : 0;
        d["ranks"] = s ? s->ranks() : 0;
        d["pending_ops"] = jaxring::host_direct_pending();
        return d;
      },
      "The host segment's state, for jaxring.transport_info().");
}
