#include "link_pacing.h"

#include <algorithm>
#include <map>
#include <mutex>
#include <tuple>
#include <vector>

namespace jaxring {

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
    if ((src / below) % size != (dst / below) % size) crossed = static_cast<int>(t);
    below *= size;
  }
  return crossed;
}

int64_t paced_arrival_ns(const OpDesc& desc, int64_t group, int src, int dst,
                         int64_t bytes, int64_t ready_ns) {
  // Leaked on purpose, like the workers that call this.
  static std::mutex* mu = new std::mutex();
  static auto* free_at = new std::map<LinkId, int64_t>();
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
  int64_t& free = (*free_at)[id];
  const int64_t start = std::max(ready_ns, free);
  free = start + busy;
  return free + static_cast<int64_t>(1e9 * link.latency_s);
}

}  // namespace jaxring
