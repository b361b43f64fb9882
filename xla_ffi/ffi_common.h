// What the CPU and CUDA FFI handlers share: XLA's element types as
// jaxring's, and the checks of the attributes every allreduce carries (the
// Python side validates them at trace time; these guard against a
// hand-written custom call).
#pragma once

#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "failure.h"
#include "reduce.h"
#include "xla/ffi/api/ffi.h"

namespace jaxring {

constexpr int64_t kMaxRings = 64;
constexpr int64_t kMaxChunkBytes = int64_t{1} << 40;
constexpr double kMaxTimeoutS = 7 * 24 * 3600.0;
constexpr double kInfinity = std::numeric_limits<double>::infinity();

// The XLA status for a failure message, from its tag (failure.h); INTERNAL
// for a message without one.
inline xla::ffi::Error failure_error(const std::string& message) {
  namespace ffi = xla::ffi;
  FailureKind kind = FailureKind::kInternal;
  int peer = -1;
  std::string rest;
  parse_tag(message, &kind, &peer, &rest);
  switch (kind) {
    case FailureKind::kPeerLost:
      return ffi::Error(ffi::ErrorCode::kUnavailable, message);
    case FailureKind::kTimeout:
      return ffi::Error(ffi::ErrorCode::kDeadlineExceeded, message);
    case FailureKind::kMismatch:
      return ffi::Error(ffi::ErrorCode::kFailedPrecondition, message);
    case FailureKind::kInvalid:
      return ffi::Error(ffi::ErrorCode::kInvalidArgument, message);
    case FailureKind::kResource:
      return ffi::Error(ffi::ErrorCode::kResourceExhausted, message);
    case FailureKind::kInternal: break;
  }
  return ffi::Error(ffi::ErrorCode::kInternal, message);
}

inline std::optional<ElemType> to_elem_type(xla::ffi::DataType t) {
  namespace ffi = xla::ffi;
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

// Checks the element type, op, world size, rings, chunk size and timeout;
// on success sets *type and *op. Returns the error message otherwise.
inline std::optional<std::string> check_allreduce_attrs(
    xla::ffi::DataType dtype, int64_t reduce_op, int64_t world_size,
    int64_t num_rings, int64_t chunk_bytes, double timeout_s, ElemType* type,
    ReduceOp* op) {
  const std::optional<ElemType> t = to_elem_type(dtype);
  if (!t) return "jaxring allreduce: unsupported dtype";
  if (!reduce_op_from_int(reduce_op, op)) {
    return "jaxring allreduce: unknown reduction op";
  }
  if (world_size < 1 || num_rings < 1 || chunk_bytes < 1 || !(timeout_s > 0)) {
    return "jaxring allreduce: world_size, rings, chunk_bytes and timeout "
           "must be positive";
  }
  // The bounds jaxring.config checks (config.py), again before the values
  // are narrowed: rings to an int, the timeout into a deadline.
  if (num_rings > kMaxRings || chunk_bytes > kMaxChunkBytes ||
      !(timeout_s <= kMaxTimeoutS)) {
    return "jaxring allreduce: rings, chunk_bytes or timeout beyond their "
           "bounds (64 rings, 2**40 bytes, 7 days)";
  }
  *type = *t;
  return std::nullopt;
}

// Checks the topology attribute (the plan's tiers, tightest first; none
// means one flat ring) against the world size and sets *dims to it. The
// TCP transport packs the tiers into a frame header: at most 4, each below
// 2**16.
inline std::optional<std::string> check_topology(
    xla::ffi::Span<const int64_t> topology, int64_t world_size,
    std::vector<int>* dims) {
  dims->clear();
  if (topology.size() > 4) {
    return "jaxring allreduce: a topology has at most 4 tiers of 1 to 65535 "
           "ranks";
  }
  int64_t product = 1;
  for (int64_t t : topology) {
    if (t < 1 || t > 0xffff) {
      return "jaxring allreduce: a topology has at most 4 tiers of 1 to 65535 "
             "ranks";
    }
    // Each factor < 2**16 and the product checked before it grows: no overflow.
    if (product > world_size) break;
    product *= t;
    dims->push_back(static_cast<int>(t));
  }
  if (topology.size() > 0 && product != world_size) {
    return "jaxring allreduce: the topology does not multiply to the world "
           "size";
  }
  return std::nullopt;
}

}  // namespace jaxring
