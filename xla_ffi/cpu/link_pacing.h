// Link emulation for the plan executor: when a unit sent between two ranks
// of one process would have arrived over the emulated cluster's links
// (OpDesc::link), so that a two-tier cluster (hosts of devices, say) can be
// measured inside one process.
//
// The model. Rank r sits at coordinate (r / (s0 ... s(t-1))) % st of tier t
// (s = the tiers' sizes, tightest first). A transfer from src to dst
// crosses the link of the loosest tier t at which their coordinates differ.
// That link belongs to src's group of tier t-1 (src itself at tier 0): all
// the ranks of a host share its one link to the other hosts, as they share
// one NIC. Transfers leave a link one after the other, in the order they are
// booked, each taking bytes / bandwidth, and arrive the latency later.
//
// Links are kept per ring group (OpKey::group), world size and tier sizes,
// so operations of one group that run at once (overlapped buckets) share
// them, as they share a real network.
#pragma once

#include <cstdint>

#include "operation.h"

namespace jaxring {

// The tier whose link a transfer from src to dst crosses.
int crossed_tier(const OpDesc& desc, int src, int dst);

// Books a transfer of `bytes` from src to dst of an operation of ring group
// `group`, whose data is ready at ready_ns (steady clock), on the link it
// crosses; returns when it arrives there.
int64_t paced_arrival_ns(const OpDesc& desc, int64_t group, int src, int dst,
                         int64_t bytes, int64_t ready_ns);

}  // namespace jaxring
