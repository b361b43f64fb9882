// The "algorithm" attribute of every allreduce custom call: one enum for
// both backends, named once for Python (_jaxring.ALGORITHMS). Each backend
// runs some of the values and refuses the others with a clear error.
#pragma once

#include <cstdint>

namespace jaxring {

enum class Algorithm : int {
  // The ring plan: 2(p-1) steps of neighbour transfers (or the tiered
  // plan's phases). Both backends; on the CPU, in one process or across
  // processes, and under link emulation. Which CPU executor runs each
  // algorithm where: the table in cpu/dispatch.cc.
  kRing = 0,
  // CPU, in one process or across the processes of one host (over the
  // host segment they all map): rank i reduces segment i of every rank's
  // input and writes it into every rank's output. Each byte is read once
  // and written once per rank, against about five times for a ring over
  // shared memory, and there are two synchronisations instead of 2(p-1).
  kDirect = 1,
  // CUDA only: NCCL's own allreduce, chunk by chunk, on the ring's
  // communicator (a reference to compare the ring with).
  kNccl = 2,
  // CPU, in one process or across processes: recursive doubling. The ranks
  // exchange their whole partial sums with a partner once per factor 2 of
  // the world size (and run a ring allreduce over an odd factor left), so
  // 8 ranks take 3 steps where the ring takes 14, each sending the whole
  // buffer: for small allreduces, whose time is the steps' latency (see
  // tiered_plan.h, PlanShape::kExchange).
  kExchange = 3,
};

// Sets *out and returns true for a value of the enum; false otherwise.
inline bool algorithm_from_int(int64_t v, Algorithm* out) {
  if (v < 0 || v > static_cast<int64_t>(Algorithm::kExchange)) return false;
  *out = static_cast<Algorithm>(v);
  return true;
}

inline const char* algorithm_name(Algorithm a) {
  switch (a) {
    case Algorithm::kRing: return "ring";
    case Algorithm::kDirect: return "direct";
    case Algorithm::kNccl: return "nccl";
    case Algorithm::kExchange: return "exchange";
  }
  return "unknown";
}

}  // namespace jaxring
