// Bindings: the ring and tiered plans, for inspection and the tests of
// their schedules.
#include <nanobind/nanobind.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <stdexcept>

#include "plan.h"
#include "tiered_plan.h"
#include "bindings/bindings.h"

namespace nb = nanobind;

namespace {

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

namespace {

void bind_ring_plan(nb::module_& m) {
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
}

const char* const kPhaseKinds[] = {"reduce_scatter", "allreduce", "all_gather",
                                   "exchange"};

void bind_tiered_plan_tables(nb::class_<jaxring::TieredPlan>& plan);

void bind_tiered_plan(nb::module_& m) {
  auto plan =
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
              "exchange=True: the exchange shape (recursive doubling) over "
              "dims, "
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
          .def_prop_ro("num_phases", &jaxring::TieredPlan::num_phases);
  bind_tiered_plan_tables(plan);
}

// The plan's tables per phase, rank and unit, for the schedule's tests.
void bind_tiered_plan_tables(nb::class_<jaxring::TieredPlan>& plan) {
  plan.def(
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
}

}  // namespace

void jaxring::bindings::plans(nb::module_& m) {
  bind_ring_plan(m);
  bind_tiered_plan(m);

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
}
