#include "cpu/operation.h"

#include <sstream>

namespace jaxring {

std::string OpDesc::describe() const {
  std::ostringstream os;
  os << count << " x " << elem_type_name(type) << ", op=" << reduce_op_name(op)
     << ", world=" << world_size << ", rings=" << num_rings
     << ", chunk_bytes=" << chunk_bytes;
  if (algorithm != Algorithm::kRing)
    os << ", algorithm=" << algorithm_name(algorithm);
  if (!topology.empty()) {
    os << ", topology=";
    for (size_t i = 0; i < topology.size(); ++i) {
      os << (i ? "x" : "") << topology[i];
    }
  }
  if (link.size() == 1) {
    os << ", emulated link " << link[0].bytes_per_s << " B/s + "
       << link[0].latency_s << " s";
  } else if (!link.empty()) {
    os << ", emulated links";
    for (size_t i = 0; i < link.size(); ++i) {
      os << (i ? "; " : " ") << link[i].size << " x " << link[i].bytes_per_s
         << " B/s + " << link[i].latency_s << " s";
    }
  }
  if (!shapes.empty()) os << ", shapes " << shapes;
  return os.str();
}

std::string shape_difference(uint32_t mine, uint32_t theirs) {
  if (shapes_agree(mine, theirs)) return "";
  return " (operands of other shapes: the same element count is not enough)";
}

}  // namespace jaxring
