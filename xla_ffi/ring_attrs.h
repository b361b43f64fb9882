// The attributes of jaxring's custom calls, one schema for both backends:
// RingAttrs is what every allreduce carries, on the CPU and on CUDA; each
// call's struct adds what its backend needs. XLA FFI decodes the call's
// attribute dictionary into the struct. The Python side builds them in
// jaxring/_src/call_attributes.py (lowering_cuda.py adds CUDA's);
// their values are checked in C++ once per backend: describe_op in
// cpu/allreduce_handler.cc, describe in cuda/ring_ops.cc, both starting
// from check_allreduce_attrs (ffi_common.h).
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
  int64_t algorithm;  // Algorithm (algorithm.h)
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

// The CPU split-phase start's: a ring operation's, and how it is started.
struct StartAttrs {
  RingAttrs ring;
  int64_t num_deps;  // leading operands that are ordering dependencies only
  bool gang;         // wait for the in-process peers (gang_start.h)
};

// The CUDA backend's: a ring operation's (rings of one size: no group
// sizes or emulated links; a topology's tiers run on the rings'
// communicators), and which GPU runs each rank and the NCCL communicators'
// ids.
struct CudaAttrs {
  RingAttrs ring;
  // The device ordinal of each rank (-1 for another process's), beside
  // ring.rank_process, one row of world_size per group.
  xla::ffi::Span<const int64_t> rank_device;
  // One NCCL unique id per (group, ring): 128 bytes as 16 int64.
  xla::ffi::Span<const int64_t> nccl_ids;
};

// The CUDA split-phase start's.
struct CudaStartAttrs {
  RingAttrs ring;
  int64_t num_deps;  // operands that are ordering dependencies only
  xla::ffi::Span<const int64_t> rank_device;
  xla::ffi::Span<const int64_t> nccl_ids;
};

}  // namespace jaxring

#define JAXRING_RING_ATTR_MEMBERS                                              \
  ::xla::ffi::StructMember<int64_t>("op_id"),                                  \
      ::xla::ffi::StructMember<int64_t>("slot_id"),                            \
      ::xla::ffi::StructMember<int64_t>("world_size"),                         \
      ::xla::ffi::StructMember<int64_t>("reduce_op"),                          \
      ::xla::ffi::StructMember<int64_t>("num_rings"),                          \
      ::xla::ffi::StructMember<int64_t>("chunk_bytes"),                        \
      ::xla::ffi::StructMember<double>("timeout_s"),                           \
      ::xla::ffi::StructMember<int64_t>("algorithm"),                          \
      ::xla::ffi::StructMember<xla::ffi::Span<const int64_t>>("topology"),     \
      ::xla::ffi::StructMember<xla::ffi::Span<const int64_t>>("rank_process"), \
      ::xla::ffi::StructMember<xla::ffi::Span<const int64_t>>("group_sizes"),  \
      ::xla::ffi::StructMember<xla::ffi::Span<const double>>(                  \
          "link_bytes_per_s"),                                                 \
      ::xla::ffi::StructMember<xla::ffi::Span<const double>>(                  \
          "link_latency_s"),                                                   \
      ::xla::ffi::StructMember<xla::ffi::Span<const int64_t>>("link_tiers")

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(jaxring::RingAttrs,
                                      JAXRING_RING_ATTR_MEMBERS);
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(
    jaxring::StartAttrs, JAXRING_RING_ATTR_MEMBERS,
    ::xla::ffi::StructMember<int64_t>("num_deps"),
    ::xla::ffi::StructMember<bool>("gang"));
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(
    jaxring::CudaAttrs, JAXRING_RING_ATTR_MEMBERS,
    ::xla::ffi::StructMember<xla::ffi::Span<const int64_t>>("rank_device"),
    ::xla::ffi::StructMember<xla::ffi::Span<const int64_t>>("nccl_ids"));
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(
    jaxring::CudaStartAttrs, JAXRING_RING_ATTR_MEMBERS,
    ::xla::ffi::StructMember<int64_t>("num_deps"),
    ::xla::ffi::StructMember<xla::ffi::Span<const int64_t>>("rank_device"),
    ::xla::ffi::StructMember<xla::ffi::Span<const int64_t>>("nccl_ids"));
