#include "allreduce_handler.h"

#include <cstring>
#include <optional>
#include <sstream>
#include <string>

#include "../reduce.h"
#include "inprocess_transport.h"

namespace ffi = xla::ffi;

namespace jaxring {

namespace {

std::optional<ElemType> to_elem_type(ffi::DataType t) {
  switch (t) {
    case ffi::F16: return ElemType::kF16;
    case ffi::BF16: return ElemType::kBF16;
    case ffi::F32: return ElemType::kF32;
    case ffi::F64: return ElemType::kF64;
    case ffi::S8: return ElemType::kS8;
    case ffi::S16: return ElemType::kS16;
    case ffi::S32: return ElemType::kS32;
    case ffi::S64: return ElemType::kS64;
    case ffi::U8: return ElemType::kU8;
    case ffi::U16: return ElemType::kU16;
    case ffi::U32: return ElemType::kU32;
    case ffi::U64: return ElemType::kU64;
    default: return std::nullopt;
  }
}

ffi::Future failed_future(const std::string& message) {
  ffi::Promise promise;
  ffi::Future future(promise);
  promise.SetError(ffi::Error(ffi::ErrorCode::kInvalidArgument, message));
  return future;
}

ffi::Future AllreduceCpuImpl(ffi::RunId run_id, int32_t device,
                             ffi::AnyBuffer x, ffi::Buffer<ffi::S32> rank_buf,
                             ffi::Buffer<ffi::S32> group_buf,
                             ffi::Result<ffi::AnyBuffer> out, int64_t op_id,
                             int64_t world_size, int64_t reduce_op,
                             int64_t num_rings, int64_t chunk_bytes,
                             double timeout_s) {
  // The Python side validates all of this at trace time; these checks guard
  // against a hand-written custom call.
  const std::optional<ElemType> type = to_elem_type(x.element_type());
  if (!type) return failed_future("jaxring allreduce: unsupported dtype");
  ReduceOp op;
  if (!reduce_op_from_int(reduce_op, &op)) {
    return failed_future("jaxring allreduce: unknown reduction op");
  }
  if (world_size < 1 || num_rings < 1 || chunk_bytes < 1 || timeout_s <= 0) {
    return failed_future(
        "jaxring allreduce: world_size, rings, chunk_bytes and timeout must "
        "be positive");
  }
  const int rank = rank_buf.typed_data()[0];
  const int64_t group = group_buf.typed_data()[0];
  if (rank < 0 || rank >= world_size) {
    std::ostringstream os;
    os << "jaxring allreduce: rank " << rank << " outside [0, " << world_size
       << ")";
    return failed_future(os.str());
  }

  const int64_t count = static_cast<int64_t>(x.element_count());
  if (world_size == 1) {
    if (out->untyped_data() != x.untyped_data() && count > 0) {
      std::memcpy(out->untyped_data(), x.untyped_data(), x.size_bytes());
    }
    ffi::Promise promise;
    ffi::Future future(promise);
    promise.SetAvailable();
    return future;
  }

  OpKey key{run_id.run_id, op_id, group};
  OpDesc desc;
  desc.type = *type;
  desc.op = op;
  desc.count = count;
  desc.world_size = static_cast<int>(world_size);
  desc.num_rings = static_cast<int>(num_rings);
  desc.chunk_bytes = chunk_bytes;

  ffi::Promise promise;
  ffi::Future future(promise);
  inprocess_allreduce(
      key, desc, rank, device, x.untyped_data(), out->untyped_data(),
      timeout_s,
      [promise](const std::optional<std::string>& error) mutable {
        if (error) {
          promise.SetError(ffi::Error(ffi::ErrorCode::kDeadlineExceeded, *error));
        } else {
          promise.SetAvailable();
        }
      });
  return future;
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    AllreduceCpu, AllreduceCpuImpl,
    ffi::Ffi::Bind()
        .Ctx<ffi::RunId>()          // one id per execution, same on all devices
        .Ctx<ffi::DeviceOrdinal>()  // picks this device's worker thread
        .Arg<ffi::AnyBuffer>()      // x: this rank's contribution
        .Arg<ffi::Buffer<ffi::S32>>()  // rank of this device in its group
        .Arg<ffi::Buffer<ffi::S32>>()  // which group (ring) it belongs to
        .Ret<ffi::AnyBuffer>()      // the reduced result
        .Attr<int64_t>("op_id")     // call-site identity, set at trace time
        .Attr<int64_t>("world_size")
        .Attr<int64_t>("reduce_op")
        .Attr<int64_t>("num_rings")
        .Attr<int64_t>("chunk_bytes")
        .Attr<double>("timeout_s"));

}  // namespace jaxring
