#include "allreduce_handler.h"

#include <atomic>
#include <chrono>
#include <cstring>
#include <functional>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "../ffi_common.h"
#include "../reduce.h"
#include "inprocess_transport.h"
#include "ring_transport.h"
#include "split_phase.h"

namespace ffi = xla::ffi;

namespace jaxring {

namespace {

ffi::Future failed_future(const std::string& message) {
  ffi::Promise promise;
  ffi::Future future(promise);
  promise.SetError(ffi::Error(ffi::ErrorCode::kInvalidArgument, message));
  return future;
}

// The emulated cluster's tiers from the link attributes (one entry per tier;
// empty: no emulation). Every tier's size but the last is given; the last,
// given as 0, takes the rest of the ranks.
std::optional<std::string> describe_link(ffi::Span<const double> bytes_per_s,
                                         ffi::Span<const double> latency_s,
                                         ffi::Span<const int64_t> tiers,
                                         int64_t world_size, OpDesc* desc) {
  const size_t n = bytes_per_s.size();
  if (latency_s.size() != n || tiers.size() != n || n > 4) {
    return "jaxring allreduce: the emulated links need a bandwidth, a latency "
           "and a size for each of at most 4 tiers";
  }
  desc->link.clear();
  int64_t inner = 1;  // ranks per group of the tier below
  for (size_t t = 0; t < n; ++t) {
    // NaN fails both comparisons, so it is refused with the negatives.
    if (!(bytes_per_s[t] > 0 && bytes_per_s[t] < kInfinity) ||
        !(latency_s[t] >= 0 && latency_s[t] <= 60.0)) {
      return "jaxring allreduce: an emulated link's bandwidth must be finite "
             "and positive, its latency finite, not negative, at most 60 s";
    }
    int64_t size = tiers[t];
    if (t + 1 == n) {
      if (size != 0 || world_size % inner != 0) {
        return "jaxring allreduce: the emulated cluster's tiers do not divide "
               "the ring's ranks";
      }
      size = world_size / inner;
    } else if (size < 1 || size > world_size || inner * size > world_size) {
      return "jaxring allreduce: an emulated tier of 1 to world_size ranks";
    }
    inner *= size;
    desc->link.push_back({static_cast<int>(size), bytes_per_s[t], latency_s[t]});
  }
  return std::nullopt;
}

// Checks the attributes (the Python side validates them at trace time; this
// guards against a hand-written custom call) and builds the description.
std::optional<std::string> describe_op(ffi::DataType dtype, int64_t count,
                                       int rank, int64_t world_size,
                                       int64_t reduce_op, int64_t num_rings,
                                       int64_t chunk_bytes, double timeout_s,
                                       ffi::Span<const double> link_bytes_per_s,
                                       ffi::Span<const double> link_latency_s,
                                       ffi::Span<const int64_t> link_tiers,
                                       int64_t algorithm,
                                       ffi::Span<const int64_t> topology,
                                       OpDesc* desc) {
  ElemType type;
  ReduceOp op;
  if (auto error = check_allreduce_attrs(dtype, reduce_op, world_size, num_rings,
                                         chunk_bytes, timeout_s, &type, &op)) {
    return error;
  }
  if (auto error = describe_link(link_bytes_per_s, link_latency_s, link_tiers,
                                 world_size, desc)) {
    return error;
  }
  if (algorithm != static_cast<int64_t>(Algorithm::kRing) &&
      algorithm != static_cast<int64_t>(Algorithm::kDirect)) {
    return "jaxring allreduce: unknown algorithm";
  }
  if (rank < 0 || rank >= world_size) {
    std::ostringstream os;
    os << "jaxring allreduce: rank " << rank << " outside [0, " << world_size
       << ")";
    return os.str();
  }
  desc->type = type;
  desc->op = op;
  desc->count = count;
  desc->world_size = static_cast<int>(world_size);
  desc->num_rings = static_cast<int>(num_rings);
  desc->chunk_bytes = chunk_bytes;
  desc->algorithm = static_cast<Algorithm>(algorithm);
  // The tiers of the plan, tightest first; none means one flat ring. The
  // TCP transport packs them into a frame header: at most 4, each < 2^16.
  desc->topology.clear();
  int64_t product = 1;
  for (int64_t t : topology) {
    if (t < 1 || t > 0xffff || topology.size() > 4) {
      return "jaxring allreduce: a topology has at most 4 tiers of 1 to "
             "65535 ranks";
    }
    // world_size < 2^31 and t < 2^16: checked first, the product stays small.
    if (product > world_size) break;
    product *= t;
    desc->topology.push_back(static_cast<int>(t));
  }
  if (topology.size() > 0 && product != world_size) {
    return "jaxring allreduce: the topology does not multiply to the world size";
  }
  return std::nullopt;
}

// The size of ring `group`: world_size, or its entry in group_sizes where
// rings differ in size (uneven axis_index_groups; world_size is then the
// largest, the row length of the rank_process table).
std::optional<std::string> size_of_group(ffi::Span<const int64_t> group_sizes,
                                         int64_t group, int64_t world_size,
                                         int64_t* size) {
  *size = world_size;
  if (group_sizes.size() == 0) return std::nullopt;
  if (group < 0 || group >= static_cast<int64_t>(group_sizes.size())) {
    return "jaxring allreduce: the group_sizes table has no entry for this group";
  }
  *size = group_sizes[group];
  if (*size < 1 || *size > world_size) {
    return "jaxring allreduce: a group size outside [1, world_size]";
  }
  return std::nullopt;
}

// The processes running the ranks of `group`: the first `size` entries of
// row `group` of the rank_process table (groups x world_size, row-major),
// or an error.
std::optional<std::string> processes_of_group(
    ffi::Span<const int64_t> rank_process, int64_t group, int64_t world_size,
    int64_t size, std::vector<int>* out) {
  const int64_t begin = group * world_size;
  if (group < 0 || begin + world_size > static_cast<int64_t>(rank_process.size())) {
    return "jaxring allreduce: the rank_process table has no row for this group";
  }
  out->assign(rank_process.begin() + begin, rank_process.begin() + begin + size);
  return std::nullopt;
}

// Transport threads now inside a promise's completion (wait_for_completions).
std::atomic<int> g_completing{0};

// A promise completed by the transport, with the status its failure's tag
// names.
ffi::Future future_for(std::function<void(Completion)> start) {
  ffi::Promise promise;
  ffi::Future future(promise);
  start([promise](const std::optional<std::string>& error) mutable {
    g_completing.fetch_add(1);
    if (error) {
      promise.SetError(failure_error(*error));
    } else {
      promise.SetAvailable();
    }
    g_completing.fetch_sub(1);
  });
  return future;
}

ffi::Future AllreduceCpuImpl(ffi::RunId run_id, int32_t device,
                             ffi::AnyBuffer x, ffi::Buffer<ffi::S32> rank_buf,
                             ffi::Buffer<ffi::S32> group_buf,
                             ffi::Result<ffi::AnyBuffer> out, int64_t op_id,
                             int64_t slot_id, int64_t world_size, int64_t reduce_op,
                             int64_t num_rings, int64_t chunk_bytes,
                             double timeout_s,
                             ffi::Span<const double> link_bytes_per_s,
                             ffi::Span<const double> link_latency_s,
                             ffi::Span<const int64_t> link_tiers, int64_t algorithm,
                             ffi::Span<const int64_t> topology,
                             ffi::Span<const int64_t> rank_process,
                             ffi::Span<const int64_t> group_sizes) {
  const int rank = rank_buf.typed_data()[0];
  const int64_t group = group_buf.typed_data()[0];
  const int64_t count = static_cast<int64_t>(x.element_count());
  int64_t ring_size = world_size;
  if (auto error = size_of_group(group_sizes, group, world_size, &ring_size)) {
    return failed_future(*error);
  }
  OpDesc desc;
  if (auto error = describe_op(x.element_type(), count, rank, ring_size,
                               reduce_op, num_rings, chunk_bytes, timeout_s,
                               link_bytes_per_s, link_latency_s, link_tiers,
                               algorithm, topology, &desc)) {
    return failed_future(*error);
  }
  desc.slot_id = slot_id;
  if (ring_size == 1) {
    if (out->untyped_data() != x.untyped_data() && count > 0) {
      std::memcpy(out->untyped_data(), x.untyped_data(), x.size_bytes());
    }
    ffi::Promise promise;
    ffi::Future future(promise);
    promise.SetAvailable();
    return future;
  }
  std::vector<int> processes;
  if (auto error = processes_of_group(rank_process, group, world_size, ring_size,
                                      &processes)) {
    return failed_future(*error);
  }
  const OpKey key{run_id.run_id, op_id, group};
  return future_for([&](Completion done) {
    ring_allreduce(key, desc, rank, device, processes, x.untyped_data(),
                   out->untyped_data(), timeout_s, std::move(done));
  });
}

// Start of the split-phase allreduce. The first num_deps remaining arguments
// are ordering dependencies only (values that must exist before this start,
// e.g. the results of buckets a credit window waits for); the rest, all of
// one dtype, are reduced as one buffer. Returns at once; the handle only
// carries the data dependency from start to done.
ffi::Error AllreduceStartCpuImpl(ffi::RunId run_id, int32_t device,
                                 ffi::Buffer<ffi::S32> rank_buf,
                                 ffi::Buffer<ffi::S32> group_buf,
                                 ffi::RemainingArgs xs,
                                 ffi::Result<ffi::Buffer<ffi::S32>> handle,
                                 int64_t op_id, int64_t slot_id,
                                 int64_t world_size,
                                 int64_t reduce_op, int64_t num_rings,
                                 int64_t chunk_bytes, double timeout_s,
                                 ffi::Span<const double> link_bytes_per_s,
                                 ffi::Span<const double> link_latency_s,
                                 ffi::Span<const int64_t> link_tiers,
                                 int64_t algorithm, int64_t num_deps, bool gang,
                                 ffi::Span<const int64_t> topology,
                                 ffi::Span<const int64_t> rank_process,
                                 ffi::Span<const int64_t> group_sizes) {
  handle->typed_data()[0] = 0;
  std::vector<ConstBytes> inputs;
  int64_t count = 0;
  ffi::DataType dtype = ffi::DataType::INVALID;
  if (num_deps < 0 || static_cast<size_t>(num_deps) > xs.size()) {
    return ffi::Error::InvalidArgument(
        "jaxring allreduce start: num_deps outside the argument list");
  }
  for (size_t i = num_deps; i < xs.size(); ++i) {
    auto x = xs.get<ffi::AnyBuffer>(i);
    if (x.has_error()) return x.error();
    if (inputs.empty()) dtype = x->element_type();
    if (x->element_type() != dtype) {
      return ffi::Error::InvalidArgument(
          "jaxring allreduce start: operands must share one dtype");
    }
    inputs.push_back({x->untyped_data(), x->size_bytes()});
    count += static_cast<int64_t>(x->element_count());
  }
  if (inputs.empty()) {
    return ffi::Error::InvalidArgument(
        "jaxring allreduce start: no operands");
  }
  const int64_t group = group_buf.typed_data()[0];
  int64_t ring_size = world_size;
  if (auto error = size_of_group(group_sizes, group, world_size, &ring_size)) {
    return ffi::Error::InvalidArgument(*error);
  }
  OpDesc desc;
  if (auto error = describe_op(dtype, count, rank_buf.typed_data()[0],
                               ring_size, reduce_op, num_rings, chunk_bytes,
                               timeout_s, link_bytes_per_s, link_latency_s,
                               link_tiers, algorithm, topology, &desc)) {
    return ffi::Error::InvalidArgument(*error);
  }
  desc.slot_id = slot_id;
  std::vector<int> processes;
  if (auto error = processes_of_group(rank_process, group, world_size, ring_size,
                                      &processes)) {
    return ffi::Error::InvalidArgument(*error);
  }
  const OpKey key{run_id.run_id, op_id, group};
  if (auto error = split_phase_start(key, desc, rank_buf.typed_data()[0],
                                     device, processes, inputs, timeout_s,
                                     gang)) {
    return failure_error(*error);
  }
  return ffi::Error::Success();
}

// Done of the split-phase allreduce: completes when the result is in its
// outputs, which have the operands' shapes in the same order. Arguments after
// the handle are ordering dependencies only: the computation that must run
// before the program waits for this result.
ffi::Future AllreduceDoneCpuImpl(ffi::RunId run_id, int32_t device,
                                 ffi::Buffer<ffi::S32> handle,
                                 ffi::RemainingArgs deps,
                                 ffi::RemainingRets outs, int64_t op_id) {
  (void)handle;
  (void)deps;
  std::vector<MutableBytes> outputs;
  for (size_t i = 0; i < outs.size(); ++i) {
    auto out = outs.get<ffi::AnyBuffer>(i);
    if (out.has_error()) return failed_future(out.error().message());
    outputs.push_back({(*out)->untyped_data(), (*out)->size_bytes()});
  }
  return future_for([&](Completion done) {
    split_phase_finish(run_id.run_id, device, op_id, std::move(outputs),
                     std::move(done));
  });
}

}  // namespace

bool wait_for_completions(double timeout_s) {
  const auto until = std::chrono::steady_clock::now() +
                     std::chrono::duration<double>(timeout_s);
  while (g_completing.load() > 0) {
    if (std::chrono::steady_clock::now() >= until) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    AllreduceCpu, AllreduceCpuImpl,
    ffi::Ffi::Bind()
        .Ctx<ffi::RunId>()          // one id per execution, same on all devices
        .Ctx<ffi::DeviceOrdinal>()  // picks this device's worker thread
        .Arg<ffi::AnyBuffer>()      // x: this rank's contribution
        .Arg<ffi::Buffer<ffi::S32>>()  // rank of this device in its group
        .Arg<ffi::Buffer<ffi::S32>>()  // which group (ring) it belongs to
        .Ret<ffi::AnyBuffer>()      // the reduced result
        .Attr<int64_t>("op_id")     // call identity, set at lowering
        .Attr<int64_t>("slot_id")   // its slot, whatever the shapes
        .Attr<int64_t>("world_size")
        .Attr<int64_t>("reduce_op")
        .Attr<int64_t>("num_rings")
        .Attr<int64_t>("chunk_bytes")
        .Attr<double>("timeout_s")
        // emulated links, one per tier (empty: off); the sizes of the
        // emulated cluster's tiers, the last given as 0 (the rest)
        .Attr<ffi::Span<const double>>("link_bytes_per_s")
        .Attr<ffi::Span<const double>>("link_latency_s")
        .Attr<ffi::Span<const int64_t>>("link_tiers")
        .Attr<int64_t>("algorithm")  // Algorithm: 0 ring, 1 direct
        // the tiered plan's tiers, tightest first; empty: one flat ring
        .Attr<ffi::Span<const int64_t>>("topology")
        // process of each rank, one row of world_size per group
        .Attr<ffi::Span<const int64_t>>("rank_process")
        // size of each group where they differ; empty: all world_size
        .Attr<ffi::Span<const int64_t>>("group_sizes"));


XLA_FFI_DEFINE_HANDLER_SYMBOL(
    AllreduceStartCpu, AllreduceStartCpuImpl,
    ffi::Ffi::Bind()
        .Ctx<ffi::RunId>()
        .Ctx<ffi::DeviceOrdinal>()
        .Arg<ffi::Buffer<ffi::S32>>()  // rank of this device in its group
        .Arg<ffi::Buffer<ffi::S32>>()  // which group (ring) it belongs to
        .RemainingArgs()               // num_deps dependencies, then operands
        .Ret<ffi::Buffer<ffi::S32>>()  // handle for done
        .Attr<int64_t>("op_id")
        .Attr<int64_t>("slot_id")
        .Attr<int64_t>("world_size")
        .Attr<int64_t>("reduce_op")
        .Attr<int64_t>("num_rings")
        .Attr<int64_t>("chunk_bytes")
        .Attr<double>("timeout_s")
        .Attr<ffi::Span<const double>>("link_bytes_per_s")
        .Attr<ffi::Span<const double>>("link_latency_s")
        .Attr<ffi::Span<const int64_t>>("link_tiers")
        .Attr<int64_t>("algorithm")
        .Attr<int64_t>("num_deps")
        .Attr<bool>("gang")  // wait for the in-process peers (gang_start.h)
        .Attr<ffi::Span<const int64_t>>("topology")
        .Attr<ffi::Span<const int64_t>>("rank_process")
        .Attr<ffi::Span<const int64_t>>("group_sizes"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    AllreduceDoneCpu, AllreduceDoneCpuImpl,
    ffi::Ffi::Bind()
        .Ctx<ffi::RunId>()
        .Ctx<ffi::DeviceOrdinal>()
        .Arg<ffi::Buffer<ffi::S32>>()  // handle from start
        .RemainingArgs()               // ordering dependencies
        .RemainingRets()               // the results, shaped like the operands
        .Attr<int64_t>("op_id"));

}  // namespace jaxring
