#include "cpu/allreduce_handler.h"

#include <atomic>
#include <chrono>
#include <cstring>
#include <functional>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "ffi_common.h"
#include "reduce.h"
#include "cpu/inprocess/inprocess_transport.h"
#include "ring_attrs.h"
#include "cpu/dispatch.h"
#include "cpu/split_phase.h"

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
    desc->link.push_back(
        {static_cast<int>(size), bytes_per_s[t], latency_s[t]});
  }
  return std::nullopt;
}

// Checks the attributes (the Python side validates them at trace time; this
// guards against a hand-written custom call) and builds the description.
std::optional<std::string> describe_op(ffi::DataType dtype, int64_t count,
                                       int rank, int64_t world_size,
                                       const RingAttrs& a, OpDesc* desc) {
  // Set by check_allreduce_attrs on success; initialized for the compiler,
  // which cannot see that.
  ElemType type{};
  ReduceOp op{};
  if (auto error =
          check_allreduce_attrs(dtype, a.reduce_op, world_size, a.num_rings,
                                a.chunk_bytes, a.timeout_s, &type, &op)) {
    return error;
  }
  if (auto error = describe_link(a.link_bytes_per_s, a.link_latency_s,
                                 a.link_tiers, world_size, desc)) {
    return error;
  }
  const ffi::Span<const int64_t> topology = a.topology;
  Algorithm algorithm;
  if (!algorithm_from_int(a.algorithm, &algorithm)) {
    return "jaxring allreduce: unknown algorithm";
  }
  if (algorithm == Algorithm::kNccl) {
    return "jaxring allreduce: algorithm 'nccl' exists on the CUDA backend "
           "only";
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
  desc->num_rings = static_cast<int>(a.num_rings);
  desc->chunk_bytes = a.chunk_bytes;
  desc->algorithm = algorithm;
  return check_topology(topology, world_size, &desc->topology);
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
    return "jaxring allreduce: the group_sizes table has no entry for this "
           "group";
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
  if (group < 0 ||
      begin + world_size > static_cast<int64_t>(rank_process.size())) {
    return "jaxring allreduce: the rank_process table has no row for this "
           "group";
  }
  out->assign(rank_process.begin() + begin,
              rank_process.begin() + begin + size);
  return std::nullopt;
}

// The operands' shapes as OpDesc records them: a digest of every operand's
// dimensions (FNV-1a, never 0) and the text of the first few.
class OperandShapes {
 public:
  void add(ffi::Span<const int64_t> dims) {
    mix(static_cast<uint64_t>(dims.size()));
    std::string text = "(";
    for (size_t i = 0; i < dims.size(); ++i) {
      mix(static_cast<uint64_t>(dims[i]));
      text += (i ? ", " : "") + std::to_string(dims[i]);
    }
    text += dims.size() == 1 ? ",)" : ")";
    if (operands_ < kShown) text_ += (operands_ ? " " : "") + text;
    ++operands_;
  }
  void describe(OpDesc* d) const {
    const uint32_t folded = static_cast<uint32_t>(hash_ ^ (hash_ >> 32));
    d->shape_digest = folded ? folded : 1;
    d->shapes = text_;
    if (operands_ > kShown) {
      d->shapes += " and " + std::to_string(operands_ - kShown) + " more";
    }
  }

 private:
  static constexpr int kShown = 3;
  void mix(uint64_t v) {
    for (int b = 0; b < 8; ++b) {
      hash_ = (hash_ ^ ((v >> (8 * b)) & 0xff)) * 0x100000001b3ull;
    }
  }
  uint64_t hash_ = 0xcbf29ce484222325ull;
  std::string text_;
  int operands_ = 0;
};

// One rank's part of a ring operation, from its custom call's attributes.
struct RankOp {
  OpKey key;
  OpDesc desc;
  int rank = 0;
  std::vector<int> processes;  // of the ranks of its ring
};

// Checks the attributes against this call (its operands' dtype and count,
// its rank and group) and describes the rank's part, or says why not.
std::optional<std::string> rank_op(const RingAttrs& a, ffi::RunId run_id,
                                   ffi::DataType dtype, int64_t count,
                                   const OperandShapes& shapes, int rank,
                                   int64_t group, RankOp* op) {
  int64_t ring_size = a.world_size;
  if (auto error =
          size_of_group(a.group_sizes, group, a.world_size, &ring_size)) {
    return error;
  }
  if (auto error = describe_op(dtype, count, rank, ring_size, a, &op->desc)) {
    return error;
  }
  op->desc.slot_id = a.slot_id;
  shapes.describe(&op->desc);
  op->key = OpKey{run_id.run_id, a.op_id, group};
  op->rank = rank;
  return processes_of_group(a.rank_process, group, a.world_size, ring_size,
                            &op->processes);
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
                             ffi::Result<ffi::AnyBuffer> out, RingAttrs attrs) {
  const int64_t count = static_cast<int64_t>(x.element_count());
  RankOp op;
  OperandShapes shapes;
  shapes.add(x.dimensions());
  if (auto error =
          rank_op(attrs, run_id, x.element_type(), count, shapes,
                  rank_buf.typed_data()[0], group_buf.typed_data()[0], &op)) {
    return failed_future(*error);
  }
  if (op.desc.world_size == 1) {
    if (out->untyped_data() != x.untyped_data() && count > 0) {
      std::memcpy(out->untyped_data(), x.untyped_data(), x.size_bytes());
    }
    ffi::Promise promise;
    ffi::Future future(promise);
    promise.SetAvailable();
    return future;
  }
  return future_for([&](Completion done) {
    cpu_allreduce(op.key, op.desc, op.rank, device, op.processes,
                  x.untyped_data(), out->untyped_data(), attrs.timeout_s,
                  std::move(done));
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
                                 StartAttrs attrs) {
  handle->typed_data()[0] = 0;
  const int64_t num_deps = attrs.num_deps;
  std::vector<ConstBytes> inputs;
  int64_t count = 0;
  OperandShapes shapes;
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
    shapes.add(x->dimensions());
  }
  if (inputs.empty()) {
    return ffi::Error::InvalidArgument("jaxring allreduce start: no operands");
  }
  RankOp op;
  if (auto error =
          rank_op(attrs.ring, run_id, dtype, count, shapes,
                  rank_buf.typed_data()[0], group_buf.typed_data()[0], &op)) {
    return ffi::Error::InvalidArgument(*error);
  }
  if (auto error =
          split_phase_start(op.key, op.desc, op.rank, device, op.processes,
                            inputs, attrs.ring.timeout_s, attrs.gang)) {
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
        .Ret<ffi::AnyBuffer>()         // the reduced result
        .Attrs<RingAttrs>());          // ring_attrs.h

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    AllreduceStartCpu, AllreduceStartCpuImpl,
    ffi::Ffi::Bind()
        .Ctx<ffi::RunId>()
        .Ctx<ffi::DeviceOrdinal>()
        .Arg<ffi::Buffer<ffi::S32>>()  // rank of this device in its group
        .Arg<ffi::Buffer<ffi::S32>>()  // which group (ring) it belongs to
        .RemainingArgs()               // num_deps dependencies, then operands
        .Ret<ffi::Buffer<ffi::S32>>()  // handle for done
        .Attrs<StartAttrs>());         // ring_attrs.h

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
