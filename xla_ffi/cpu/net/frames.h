// The TCP transport's wire format: the header that precedes every frame,
// how an operation's identity and description travel in it, and the bounds
// a received header must meet before any state is made for it. What goes
// over the wire, not how (socket_io.h) nor to whom (tcp_transport.h); the
// handshake that comes first is in tcp_handshake.h.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "cpu/operation.h"

namespace jaxring {

// Sanity bounds on what a peer announces (a corrupt or foreign client must
// not make this process allocate without limit).
constexpr int64_t kMaxMessageBytes = 1 << 20;
constexpr int64_t kMaxPayloadBytes = int64_t{1} << 40;

// kData: a chunk; kAbort: an operation failed (payload: why; `phase` holds
// the FailureKind and `src_rank` the process the failure points at, or -1);
// kPeerLost: the process in `group` is unreachable (payload: why), sent to
// every process; kShmData: a chunk whose payload_bytes wait in the
// connection's shared-memory ring (shm_link.h), not on the socket.
enum FrameKind : uint32_t {
  kData = 1,
  kAbort = 2,
  kPeerLost = 3,
  kShmData = 4
};

// Precedes every frame. Fixed layout, native byte order: every process of a
// job runs the same build on the same kind of machine.
struct FrameHeader {
  uint32_t magic;
  uint32_t kind;
  int64_t run_id;
  int64_t op_id;
  int64_t group;
  int32_t ring;
  int32_t dst_rank;
  int32_t src_rank;
  int32_t elem_type;
  int32_t reduce_op;
  int32_t world_size;
  int32_t num_rings;
  int32_t phase;          // of the tiered plan
  int32_t algorithm;      // Algorithm: kRing or kExchange (which plan)
  uint32_t shape_digest;  // OpDesc::shape_digest
  int64_t count;
  int64_t chunk_bytes;
  int64_t topology;       // the plan's tiers, packed (see pack_topology)
  int64_t unit;           // chunk-major unit index within the phase
  int64_t payload_bytes;  // data, or the abort message's length
  int64_t slot_id;        // OpDesc::slot_id
};
static_assert(sizeof(FrameHeader) == 120, "FrameHeader layout");

// A topology travels in one header word: up to four tiers of up to 16 bits
// each, tightest in the low bits; 0 is the flat ring. Python enforces the
// limits at trace time.
constexpr int kMaxTiers = 4;
constexpr int kMaxTierSize = 0xffff;

int64_t pack_topology(const std::vector<int>& dims);
std::vector<int> unpack_topology(int64_t packed);

// The operation a frame belongs to, and the description it carries.
OpKey key_of(const FrameHeader& h);
OpDesc desc_of(const FrameHeader& h);

// What ranks must agree on (link emulation does not apply across processes).
bool same_operation(const OpDesc& a, const OpDesc& b);

// "jaxring allreduce (op ..., group ..., run ..., <description>)".
std::string op_name(const OpKey& k, const OpDesc& d);

// Whether a data frame's header holds values this build could have sent
// (the bounds jaxring.config and the handlers enforce), before any state is
// made for its operation.
bool plausible_data_header(const FrameHeader& h);

}  // namespace jaxring
