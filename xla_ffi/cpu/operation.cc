#include "operation.h"

#include <sstream>

namespace jaxring {

std::string OpDesc::describe() const {
  std::ostringstream os;
  os << count << " x " << elem_type_name(type) << ", op=" << reduce_op_name(op)
     << ", world=" << world_size << ", rings=" << num_rings
     << ", chunk_bytes=" << chunk_bytes;
  if (algorithm == Algorithm::kDirect) os << ", algorithm=direct";
  if (!topology.empty()) {
    os << ", topology=";
    for (size_t i = 0; i < topology.size(); ++i) {
      os << (i ? "x" : "") << topology[i];
    }
  }
  if (link_bytes_per_s > 0) {
    os << ", emulated link " << link_bytes_per_s << " B/s + "
       << link_latency_s << " s";
  }
  return os.str();
}

}  // namespace jaxring
