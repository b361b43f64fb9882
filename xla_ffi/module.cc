// The nanobind module jaxring._jaxring: FFI handler capsules for the CPU
// backend and the ring plan, exposed for inspection and tests.
#include <nanobind/nanobind.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <memory>
#include <mutex>
#include <stdexcept>

#include "cpu/allreduce_handler.h"
#include "cpu/buffer_pool.h"
#include "cpu/gang_start.h"
#include "cpu/direct/host_direct.h"
#include "cpu/direct/host_segment.h"
#include "cpu/plan/inprocess_plan_host.h"
#include "cpu/inprocess/inprocess_transport.h"
#include "cpu/net/shm_link.h"
#include "cpu/net/socket_io.h"
#include "cpu/split_phase.h"
#include "cpu/net/tcp_transport.h"
#include "cpu/timeline.h"
#include "plan.h"
#include "tiered_plan.h"
#include "reduce.h"

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

template <typename T>
nb::capsule encapsulate_ffi(T* fn) {
  static_assert(std::is_invocable_r_v<XLA_FFI_Error*, T, XLA_FFI_CallFrame*>,
                "an XLA FFI handler");
  return nb::capsule(reinterpret_cast<void*>(fn));
}

nb::dict transfer_to_dict(const jaxring::Transfer& t) {
  nb::dict d;
  d["ring"] = t.ring;
  d["chunk"] = t.chunk;
  d["step"] = t.step;
  d["reduce"] = t.reduce;
  d["src"] = t.src_rank;
  d["dst"] = t.dst_rank;
  d["segment"] = t.segment;
  d["offset"] = t.span.offset;
  d["count"] = t.span.count;
  return d;
}

nb::dict tiered_transfer_to_dict(const jaxring::TieredTransfer& t) {
  nb::dict d;
  d["ring"] = t.ring;
  d["phase"] = t.phase;
  d["tier"] = t.tier;
  d["chunk"] = t.chunk;
  d["step"] = t.step;
  d["unit"] = t.unit;
  d["reduce"] = t.reduce;
  d["src"] = t.src_rank;
  d["dst"] = t.dst_rank;
  d["offset"] = t.span.offset;
  d["count"] = t.span.count;
  return d;
}

// The plan's accessors index its tables directly; Python gets an IndexError
// instead of a read out of range.
void check_indices(const jaxring::TieredPlan& p, int ring, int phase,
                   int rank) {
  if (ring < 0 || ring >= p.num_rings() || phase < 0 ||
      phase >= p.num_phases() || rank < 0 || rank >= p.world_size()) {
    throw nb::index_error("ring, phase or rank out of range");
  }
}

nb::tuple span_tuple(const jaxring::Span& s) {
  return nb::make_tuple(s.offset, s.count);
}

}  // namespace

NB_MODULE(_jaxring, m) {
  m.doc() = "jaxring C++ core: XLA FFI handlers and the ring plans.";

  m.def("registrations", []() {
    nb::dict d;
    d["jaxring_allreduce_cpu"] = encapsulate_ffi(jaxring::AllreduceCpu);
    d["jaxring_allreduce_start_cpu"] =
        encapsulate_ffi(jaxring::AllreduceStartCpu);
    d["jaxring_allreduce_done_cpu"] =
        encapsulate_ffi(jaxring::AllreduceDoneCpu);
    return d;
  });

  nb::class_<jaxring::RingPlan>(m, "RingPlan",
                                "A chunked multi-ring allreduce schedule.")
      .def(nb::init<int, int, int64_t, int64_t, int64_t>(),
           nb::arg("world_size"), nb::arg("rings"), nb::arg("count"),
           nb::arg("elem_bytes"), nb::arg("chunk_bytes"))
      .def_prop_ro("world_size", &jaxring::RingPlan::world_size)
      .def_prop_ro("rings", &jaxring::RingPlan::num_rings)
      .def_prop_ro("count", &jaxring::RingPlan::count)
      .def_prop_ro("elem_bytes", &jaxring::RingPlan::elem_bytes)
      .def_prop_ro("chunk_elems", &jaxring::RingPlan::chunk_elems)
      .def_prop_ro("num_steps", &jaxring::RingPlan::num_steps)
      .def("order", &jaxring::RingPlan::order, nb::arg("ring"))
      .def(
          "part",
          [](const jaxring::RingPlan& p, int r) {
            const auto s = p.part(r);
            return nb::make_tuple(s.offset, s.count);
          },
          nb::arg("ring"))
      .def("num_chunks", &jaxring::RingPlan::num_chunks, nb::arg("ring"))
      .def("bytes_sent", &jaxring::RingPlan::bytes_sent, nb::arg("rank"))
      .def("transfers",
           [](const jaxring::RingPlan& p) {
             nb::list out;
             for (const auto& t : p.transfers())
               out.append(transfer_to_dict(t));
             return out;
           })
      .def("__repr__", &jaxring::RingPlan::describe);

  static const char* kPhaseKinds[] = {"reduce_scatter", "allreduce",
                                      "all_gather", "exchange"};
  nb::class_<jaxring::TieredPlan>(
      m, "TieredPlan",
      "A multi-dimensional chunked multi-ring allreduce schedule over a "
      "topology d0 x d1 x ... (tightest tier first).")
      .def(
          "__init__",
          [](jaxring::TieredPlan* self, std::vector<int> dims, int rings,
             int64_t count, int64_t elem_bytes, int64_t chunk_bytes,
             bool exchange) {
            new (self) jaxring::TieredPlan(
                std::move(dims), rings, count, elem_bytes, chunk_bytes,
                exchange ? jaxring::PlanShape::kExchange
                         : jaxring::PlanShape::kNested);
          },
          nb::arg("dims"), nb::arg("rings"), nb::arg("count"),
          nb::arg("elem_bytes"), nb::arg("chunk_bytes"),
          nb::arg("exchange") = false,
          "exchange=True: the exchange shape (recursive doubling) over dims, "
          "as exchange_tiers(world) gives them for algorithm='exchange'.")
      .def_prop_ro("exchange",
                   [](const jaxring::TieredPlan& p) {
                     return p.shape() == jaxring::PlanShape::kExchange;
                   })
      .def_prop_ro("dims", &jaxring::TieredPlan::dims)
      .def_prop_ro("world_size", &jaxring::TieredPlan::world_size)
      .def_prop_ro("rings", &jaxring::TieredPlan::num_rings)
      .def_prop_ro("count", &jaxring::TieredPlan::count)
      .def_prop_ro("elem_bytes", &jaxring::TieredPlan::elem_bytes)
      .def_prop_ro("chunk_elems", &jaxring::TieredPlan::chunk_elems)
      .def_prop_ro("num_phases", &jaxring::TieredPlan::num_phases)
      .def(
          "phase",
          [](const jaxring::TieredPlan& p, int j) {
            if (j < 0 || j >= p.num_phases()) throw nb::index_error();
            const jaxring::Phase& ph = p.phase(j);
            nb::dict d;
            d["kind"] = kPhaseKinds[static_cast<int>(ph.kind)];
            d["tier"] = ph.tier;
            d["group_size"] = ph.group_size;
            d["first_step"] = ph.first_step;
            d["num_steps"] = ph.num_steps;
            return d;
          },
          nb::arg("phase"))
      .def(
          "coord",
          [](const jaxring::TieredPlan& p, int rank, int tier) {
            if (rank < 0 || rank >= p.world_size() || tier < 0 ||
                tier >= static_cast<int>(p.dims().size())) {
              throw nb::index_error("rank or tier out of range");
            }
            return p.coord(rank, tier);
          },
          nb::arg("rank"), nb::arg("tier"))
      .def(
          "group",
          [](const jaxring::TieredPlan& p, int r, int j, int rank) {
            check_indices(p, r, j, rank);
            return p.group(r, j, rank);
          },
          nb::arg("ring"), nb::arg("phase"), nb::arg("rank"))
      .def(
          "shard",
          [](const jaxring::TieredPlan& p, int r, int j, int rank) {
            check_indices(p, r, j, rank);
            return span_tuple(p.shard(r, j, rank));
          },
          nb::arg("ring"), nb::arg("phase"), nb::arg("rank"))
      .def(
          "num_units",
          [](const jaxring::TieredPlan& p, int r, int j, int rank) {
            check_indices(p, r, j, rank);
            return p.num_units(r, j, rank);
          },
          nb::arg("ring"), nb::arg("phase"), nb::arg("rank"))
      .def(
          "recv_span",
          [](const jaxring::TieredPlan& p, int r, int j, int rank, int64_t u) {
            check_indices(p, r, j, rank);
            return span_tuple(p.recv_span(r, j, rank, u));
          },
          nb::arg("ring"), nb::arg("phase"), nb::arg("rank"), nb::arg("unit"))
      .def(
          "send_span",
          [](const jaxring::TieredPlan& p, int r, int j, int rank, int64_t u) {
            check_indices(p, r, j, rank);
            return span_tuple(p.send_span(r, j, rank, u));
          },
          nb::arg("ring"), nb::arg("phase"), nb::arg("rank"), nb::arg("unit"))
      .def(
          "bytes_sent",
          [](const jaxring::TieredPlan& p, int rank, int tier) {
            if (rank < 0 || rank >= p.world_size()) {
              throw nb::index_error("rank out of range");
            }
            return p.bytes_sent(rank, tier);
          },
          nb::arg("rank"), nb::arg("tier"))
      .def("transfers",
           [](const jaxring::TieredPlan& p) {
             nb::list out;
             for (const auto& t : p.transfers()) {
               out.append(tiered_transfer_to_dict(t));
             }
             return out;
           })
      .def("__repr__", &jaxring::TieredPlan::describe);

  // Registers RingPlan's std::invalid_argument as ValueError.
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const std::invalid_argument& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    }
  });

  m.def("exchange_tiers", &jaxring::exchange_tiers, nb::arg("world_size"),
        "The tiers algorithm='exchange' runs over world_size ranks.");
  m.def("close_handshakes", &jaxring::close_handshakes, nb::arg("timeout_s"),
        nb::call_guard<nb::gil_scoped_release>(),
        "Refuses TCP handshakes from now on (at exit) and waits for the calls "
        "into OpenSSL in flight; false if some were still running.");
  m.def("handshakes_closed", &jaxring::handshakes_closed,
        "Whether close_handshakes was called.");
  m.def("wait_for_completions", &jaxring::wait_for_completions,
        nb::arg("timeout_s"), nb::call_guard<nb::gil_scoped_release>(),
        "Waits until no transport thread is completing an XLA future.");
  m.def(
      "inprocess_pending_ops",
      [] {
        return jaxring::inprocess_pending_ops() +
               jaxring::inprocess_plan_pending_ops();
      },
      "Operations the in-process transport (and its tiered plans' host) still "
      "holds.");
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
  m.def("gang_start_pending", &jaxring::gang_start_pending,
        "Split-phase starts still gathering their in-process ranks.");
  m.def("split_phase_unfinished_starts",
        &jaxring::split_phase_unfinished_starts,
        "Split-phase allreduces started and not yet finished.");
  m.def("split_phase_pooled_bytes", &jaxring::pooled_bytes,
        "Bytes of released split-phase buffers kept for reuse.");

  // The TCP transport between processes (set up by jaxring._src.distributed).
  m.def(
      "tcp_listen",
      [](const std::string& bind_host, int process, int processes,
         nb::bytes secret, nb::bytes job_id, bool use_shm) {
        jaxring::JobIdentity id;
        id.process = process;
        id.processes = processes;
        id.secret.assign(secret.c_str(), secret.size());
        id.job_id.assign(job_id.c_str(), job_id.size());
        std::string error;
        const int port = jaxring::tcp_listen(bind_host, id, use_shm, &error);
        if (port < 0)
          throw std::runtime_error("jaxring TCP transport: " + error);
        return port;
      },
      nb::arg("bind_host"), nb::arg("process"), nb::arg("processes"),
      nb::arg("secret"), nb::arg("job_id"), nb::arg("use_shm"),
      "Opens this process's listening socket for one job (its peers must "
      "prove the same secret and job id); returns its port. use_shm: "
      "whether shared-memory links with processes on this host are "
      "offered and taken.");
  m.def(
      "tcp_set_socket_buffer",
      [](int bytes) {
        if (bytes < 0)
          throw std::invalid_argument("a socket buffer of 0 or more bytes");
        jaxring::set_socket_buffer_bytes(bytes);
      },
      nb::arg("bytes"),
      "SO_SNDBUF and SO_RCVBUF of every TCP transport socket opened from now "
      "on, in bytes; 0: the kernel's autotuning.");
  m.def(
      "tcp_set_peers",
      [](const std::vector<std::string>& addresses,
         const std::vector<int>& same_host) {
        std::string error;
        if (!jaxring::tcp_set_peers(addresses, same_host, &error)) {
          throw std::runtime_error("jaxring TCP transport: " + error);
        }
      },
      nb::arg("addresses"), nb::arg("same_host"),
      "Sets every process's host:port, and the processes on this host.");
  m.def(
      "tcp_transport_info",
      [] {
        const jaxring::TcpTransportInfo i = jaxring::tcp_transport_info();
        nb::dict d;
        d["listening"] = i.listening;
        d["host"] = i.host;
        d["port"] = i.port;
        d["process"] = i.process;
        d["processes"] = i.processes;
        d["job_id"] = nb::bytes(i.job_id.data(), i.job_id.size());
        d["protocol_version"] = i.protocol_version;
        d["auth_library"] = i.auth_library;
        d["inbound"] = i.inbound;
        d["outbound"] = i.outbound;
        d["shm_inbound"] = i.shm_inbound;
        d["shm_outbound"] = i.shm_outbound;
        d["same_host"] = i.same_host;
        d["use_shm"] = i.use_shm;
        d["shm_unavailable"] = i.shm_unavailable;
        d["data_frames_by_device_thread"] = i.data_frames_by_device_thread;
        d["data_frames_by_sender_thread"] = i.data_frames_by_sender_thread;
        d["data_frames_finished_by_sender_thread"] =
            i.data_frames_finished_by_sender_thread;
        d["socket_buffer"] = jaxring::socket_buffer_bytes();
        d["lost_processes"] = i.lost_processes;
        d["refused_connections"] = i.refused_connections;
        d["last_refusal"] = i.last_refusal;
        d["pending_ops"] = i.pending_ops;
        return d;
      },
      "The TCP transport's state, for jaxring.transport_info().");
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
  m.def(
      "tcp_auth_library", &jaxring::tcp_auth_library,
      "The library that authenticates TCP peers, or '' if none was built in.");
  m.def("tcp_process_index", &jaxring::tcp_process_index,
        "This process's index in the TCP transport (-1: not set up).");
  m.def("tcp_pending_ops", &jaxring::tcp_pending_ops,
        "Operations the TCP transport still holds.");

  // Reduction kernels on raw bytes, for tests of rounding and wrapping.
  m.def("reduce_bytes", [](int elem_type, int op, nb::bytes a, nb::bytes b) {
    if (a.size() != b.size()) throw std::invalid_argument("size mismatch");
    const auto t = static_cast<jaxring::ElemType>(elem_type);
    const int64_t esize = jaxring::elem_bytes(t);
    if (esize == 0 || a.size() % esize) throw std::invalid_argument("bad type");
    jaxring::ReduceOp rop;
    if (!jaxring::reduce_op_from_int(op, &rop))
      throw std::invalid_argument("bad op");
    std::string out(a.size(), '\0');
    jaxring::reduce(t, rop, out.data(), a.c_str(), b.c_str(),
                    static_cast<int64_t>(a.size()) / esize);
    return nb::bytes(out.data(), out.size());
  });

  // The values of the custom calls' attributes, named once here for Python.
  m.attr("REDUCE_OPS") = [] {
    nb::dict d;
    d["sum"] = static_cast<int>(jaxring::ReduceOp::kSum);
    d["prod"] = static_cast<int>(jaxring::ReduceOp::kProd);
    d["min"] = static_cast<int>(jaxring::ReduceOp::kMin);
    d["max"] = static_cast<int>(jaxring::ReduceOp::kMax);
    return d;
  }();
  m.attr("ALGORITHMS") = [] {
    nb::dict d;
    d["ring"] = static_cast<int>(jaxring::Algorithm::kRing);
    d["direct"] = static_cast<int>(jaxring::Algorithm::kDirect);
    d["nccl"] = static_cast<int>(jaxring::Algorithm::kNccl);
    d["exchange"] = static_cast<int>(jaxring::Algorithm::kExchange);
    return d;
  }();
  m.attr("ELEM_TYPES") = [] {
    nb::dict d;
    for (int i = 0; i <= static_cast<int>(jaxring::ElemType::kU64); ++i) {
      d[jaxring::elem_type_name(static_cast<jaxring::ElemType>(i))] = i;
    }
    return d;
  }();
#ifdef JAXRING_VERSION
  m.attr("__version__") = JAXRING_VERSION;
#endif
  m.attr("built_with_jaxlib") = JAXRING_BUILT_WITH_JAXLIB;
}
