// Link emulation: when a unit sent between two ranks
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
// booked, each taking bytes / bandwidth, and arrive the latency later; a
// transfer whose data is ready while the link is idle, and that ends before
// the link's next booked transfer starts, goes in that gap (LinkTimeline).
//
// Links are kept per ring group (OpKey::group), world size and tier sizes,
// so operations of one group that run at once (overlapped buckets) share
// them, as they share a real network.
#pragma once

#include <cstdint>
#include <map>

#include "cpu/operation.h"

namespace jaxring {

// The busy times of one emulated link. Why gaps are kept: a transfer is
// booked when its sender knows when its data will be ready, which may be
// long before then (the in-process ring books a whole operation at once).
// Appending every booking after the last would make an allreduce started
// later wait for every step of one booked earlier, though on a real link
// its first chunk leaves while the earlier one waits for a neighbour.
// A transfer never moves one booked before it, so a gap too short for it
// is left (the link model stays first-come, first-served per booking).
// Not thread-safe: the caller holds a lock.
class LinkTimeline {
 public:
  // Books busy_ns of transmission that may start at ready_ns; returns when
  // it starts. now_ns is the real time (steady clock): what ended more than
  // kHistoryNs before it is forgotten, and a transfer ready before that
  // counts as ready then, so it cannot land on a forgotten interval.
  // (Bookings run ahead of real time, as an operation is booked whole:
  // forgetting by the latest ready time would drop intervals still ahead.)
  int64_t book(int64_t ready_ns, int64_t busy_ns, int64_t now_ns);
  // Busy intervals kept (for tests: old ones are dropped).
  size_t intervals() const { return busy_.size(); }

  static constexpr int64_t kHistoryNs = 2'000'000'000;

 private:
  std::map<int64_t, int64_t> busy_;  // start -> end, disjoint
};

// The tier whose link a transfer from src to dst crosses.
int crossed_tier(const OpDesc& desc, int src, int dst);

// Books a transfer of `bytes` from src to dst of an operation of ring group
// `group`, whose data is ready at ready_ns (steady clock), on the link it
// crosses; returns when it arrives there.
int64_t paced_arrival_ns(const OpDesc& desc, int64_t group, int src, int dst,
                         int64_t bytes, int64_t ready_ns);

}  // namespace jaxring
