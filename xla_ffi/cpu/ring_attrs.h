// The attributes every CPU ring custom call carries, as one struct that XLA
// FFI decodes from the call's attribute dictionary (the Python side builds
// them in jaxring/_src/allreduce.py, ring_attributes; their values are
// checked once, by describe_op in allreduce_handler.cc).
#pragma once

#include <cstdint>

#include "xla/ffi/api/ffi.h"

namespace jaxring {

struct RingAttrs {
  int64_t op_id;       // call identity, set at lowering
  int64_t slot_id;     // its slot, whatever the shapes
  int64_t world_size;  // ranks per ring (the largest, with uneven groups)
  int64_t reduce_op;   // ReduceOp
  int64_t num_rings;
  int64_t chunk_bytes;
  double timeout_s;
  int64_t algorithm;   // Algorithm
  // The tiered plan's tiers, tightest first; empty: one flat ring.
  xla::ffi::Span<const int64_t> topology;
  // The process of each rank, one row of world_size per group.
  xla::ffi::Span<const int64_t> rank_process;
  // The size of each group where they differ; empty: all world_size.
  xla::ffi::Span<const int64_t> group_sizes;
  // Emulated links, one per tier (empty: off), and the emulated cluster's
  // tier sizes, the last given as 0 (the rest).
  xla::ffi::Span<const double> link_bytes_per_s;
  xla::ffi::Span<const double> link_latency_s;
  xla::ffi::Span<const int64_t> link_tiers;
};

// The split-phase start's: a ring operation's, and how it is started.
struct StartAttrs {
  RingAttrs ring;
  int64_t num_deps;  // leading operands that are ordering dependencies only
  bool gang;         // wait for the in-process peers (gang_start.h)
};

}  // namespace jaxring

#define JAXRING_RING_ATTR_MEMBERS                                    \
  ::xla::ffi::StructMember<int64_t>("op_id"),                        \
      ::xla::ffi::StructMember<int64_t>("slot_id"),                  \
      ::xla::ffi::StructMember<int64_t>("world_size"),               \
      ::xla::ffi::StructMember<int64_t>("reduce_op"),                \
      ::xla::ffi::StructMember<int64_t>("num_rings"),                \
      ::xla::ffi::StructMember<int64_t>("chunk_bytes"),              \
      ::xla::ffi::StructMember<double>("timeout_s"),                 \
      ::xla::ffi::StructMember<int64_t>("algorithm"),                \
      ::xla::ffi::StructMember<xla::ffi::Span<const int64_t>>("topology"), \
      ::xla::ffi::StructMember<xla::ffi::Span<const int64_t>>("rank_process"), \
      ::xla::ffi::StructMember<xla::ffi::Span<const int64_t>>("group_sizes"), \
      ::xla::ffi::StructMember<xla::ffi::Span<const double>>("link_bytes_per_s"), \
      ::xla::ffi::StructMember<xla::ffi::Span<const double>>("link_latency_s"), \
      ::xla::ffi::StructMember<xla::ffi::Span<const int64_t>>("link_tiers")

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(jaxring::RingAttrs, JAXRING_RING_ATTR_MEMBERS);
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(jaxring::StartAttrs, JAXRING_RING_ATTR_MEMBERS,
                                      ::xla::ffi::StructMember<int64_t>("num_deps"),
                                      ::xla::ffi::StructMember<bool>("gang"));
