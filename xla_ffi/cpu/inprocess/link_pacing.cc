#include "cpu/inprocess/link_pacing.h"

#include "cpu/timeline.h"

#include <algorithm>
#include <iterator>
#include <map>
#include <mutex>
#include <tuple>
#include <vector>

namespace jaxring {

int64_t LinkTimeline::book(int64_t ready_ns, int64_t busy_ns, int64_t now_ns) {
  const int64_t horizon = now_ns - kHistoryNs;
  while (!busy_.empty() && busy_.begin()->second <= horizon) {
    busy_.erase(busy_.begin());
  }
  int64_t start = std::max(ready_ns, horizon);
  // An empty unit still needs the link free (its frame has a header).
  const int64_t need = std::max<int64_t>(busy_ns, 1);
  // The first interval that could overlap [start, ...): the last one that
  // starts at or before it, else the first after it.
  auto it = busy_.upper_bound(start);
  if (it != busy_.begin() && std::prev(it)->second > start) --it;
  for (; it != busy_.end(); ++it) {
    if (it->first >= start + need) break;  // fits in the gap before it
    start = std::max(start, it->second);
  }
  if (busy_ns > 0) {
    // Joins a neighbour it touches, to keep the map short.
    auto [pos, inserted] = busy_.emplace(start, start + busy_ns);
    (void)inserted;
    auto next = std::next(pos);
    if (next != busy_.end() && next->first == pos->second) {
      pos->second = next->second;
      busy_.erase(next);
    }
    if (pos != busy_.begin()) {
      auto before = std::prev(pos);
      if (before->second == pos->first) {
        before->second = pos->second;
        busy_.erase(pos);
      }
    }
  }
  return start;
}

namespace {

struct LinkId {
  int64_t group;
  int world;
  std::vector<int> tiers;
  int tier;
  int owner;  // src's group of the tier below (src itself at tier 0)
  bool operator<(const LinkId& o) const {
    return std::tie(group, world, tiers, tier, owner) <
           std::tie(o.group, o.world, o.tiers, o.tier, o.owner);
  }
};

}  // namespace

int crossed_tier(const OpDesc& desc, int src, int dst) {
  int crossed = 0;
  int64_t below = 1;  // ranks per group of the tier below
  for (size_t t = 0; t < desc.link.size(); ++t) {
    const int size = desc.link[t].size;
    if ((src / below) % size != (dst / below) % size)
      crossed = static_cast<int>(t);
    below *= size;
  }
  return crossed;
}

int64_t paced_arrival_ns(const OpDesc& desc, int64_t group, int src, int dst,
                         int64_t bytes, int64_t ready_ns) {
  // Leaked on purpose, like the workers that call this.
  static std::mutex* mu = new std::mutex();
  static auto* links = new std::map<LinkId, LinkTimeline>();
  const int t = crossed_tier(desc, src, dst);
  int64_t below = 1;
  for (int i = 0; i < t; ++i) below *= desc.link[i].size;
  std::vector<int> tiers;
  for (const EmulatedTier& e : desc.link) tiers.push_back(e.size);
  const LinkId id{group, desc.world_size, std::move(tiers), t,
                  static_cast<int>(src / below)};
  const EmulatedTier& link = desc.link[t];
  const int64_t busy = static_cast<int64_t>(1e9 * bytes / link.bytes_per_s);
  std::lock_guard<std::mutex> lock(*mu);
  const int64_t start = (*links)[id].book(ready_ns, busy, timeline_now_ns());
  return start + busy + static_cast<int64_t>(1e9 * link.latency_s);
}

}  // namespace jaxring
