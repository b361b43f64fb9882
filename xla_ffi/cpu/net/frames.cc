#include "cpu/net/frames.h"

#include <sstream>

#include "reduce.h"

namespace jaxring {

int64_t pack_topology(const std::vector<int>& dims) {
  uint64_t packed = 0;
  for (size_t i = 0; i < dims.size() && i < kMaxTiers; ++i) {
    packed |= static_cast<uint64_t>(dims[i] & kMaxTierSize) << (16 * i);
  }
  return static_cast<int64_t>(packed);
}

std::vector<int> unpack_topology(int64_t packed) {
  std::vector<int> dims;
  for (int i = 0; i < kMaxTiers; ++i) {
    const int d = static_cast<int>((static_cast<uint64_t>(packed) >> (16 * i)) &
                                   kMaxTierSize);
    if (d == 0) break;
    dims.push_back(d);
  }
  return dims;
}

OpKey key_of(const FrameHeader& h) { return {h.run_id, h.op_id, h.group}; }

OpDesc desc_of(const FrameHeader& h) {
  OpDesc d;
  d.type = static_cast<ElemType>(h.elem_type);
  d.op = static_cast<ReduceOp>(h.reduce_op);
  d.count = h.count;
  d.world_size = h.world_size;
  d.num_rings = h.num_rings;
  d.chunk_bytes = h.chunk_bytes;
  d.topology = unpack_topology(h.topology);
  d.algorithm = static_cast<Algorithm>(h.algorithm);  // checked: plausible_...
  d.slot_id = h.slot_id;
  d.shape_digest = h.shape_digest;
  return d;
}

bool same_operation(const OpDesc& a, const OpDesc& b) {
  return a.type == b.type && a.op == b.op && a.count == b.count &&
         shapes_agree(a.shape_digest, b.shape_digest) &&
         a.world_size == b.world_size && a.num_rings == b.num_rings &&
         a.chunk_bytes == b.chunk_bytes && a.topology == b.topology &&
         a.algorithm == b.algorithm;
}

std::string op_name(const OpKey& k, const OpDesc& d) {
  std::ostringstream os;
  os << "jaxring allreduce (op " << k.op_id << ", group " << k.group << ", run "
     << k.run_id << ", " << d.describe() << ")";
  return os.str();
}

bool plausible_data_header(const FrameHeader& h) {
  ReduceOp unused;
  return h.elem_type >= 0 && h.elem_type <= static_cast<int>(ElemType::kU64) &&
         reduce_op_from_int(h.reduce_op, &unused) && h.world_size >= 1 &&
         h.num_rings >= 1 && h.num_rings <= 64 && h.ring >= 0 &&
         h.ring < h.num_rings && h.dst_rank >= 0 && h.dst_rank < h.world_size &&
         h.src_rank >= 0 && h.src_rank < h.world_size && h.phase >= 0 &&
         h.count >= 0 && h.chunk_bytes >= 1 &&
         h.chunk_bytes <= (int64_t{1} << 40) && h.unit >= 0 &&
         // Only these plans cross processes (direct and nccl never do).
         (h.algorithm == static_cast<int32_t>(Algorithm::kRing) ||
          h.algorithm == static_cast<int32_t>(Algorithm::kExchange));
}

}  // namespace jaxring
