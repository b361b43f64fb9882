// The tiered plan in stream order: how an issuer that cannot wait for a
// unit to arrive (the CUDA backend, which enqueues NCCL calls and kernels
// on a stream and returns) runs the same schedule as the CPU executor.
//
// Pure, like the plans. The CPU executor reacts to arrivals; a stream
// instead runs, per ring, one fixed sequence of exchanges, each a send of
// one span to the next rank and a receive of one span from the previous
// rank, then the reduce of what came. Every rank of a group issues its
// exchanges in the same order (phase by phase, unit by unit), so the send
// of unit u meets the peer's receive of unit u, and each exchange only
// reads what the exchanges before it on the stream finished: unit u + 1
// sends the range unit u received (plan: recv_span(u) == send_span(u + 1)).
//
// Being one description of the plan's units, it cannot drift from the
// executor's; tests/cpp/plan_test.cc runs it in lockstep over memory and
// compares the bits with the executor's.
#pragma once

#include <cstdint>
#include <vector>

#include "tiered_plan.h"

namespace jaxring {

struct StreamExchange {
  int phase = 0;
  int64_t unit = 0;
  Span send;            // count 0: nothing to send in this exchange
  int to = 0;           // the rank sent to (the next rank of the phase's ring)
  Span recv;            // count 0: nothing to receive
  int from = 0;         // the rank received from
  bool reduce = false;  // reduce what came into recv (else it is stored)
};

// Ring `ring`'s exchanges for `rank`, in the order a stream issues them:
// phase by phase, unit by unit. Units that move nothing either way are
// left out (every rank of a group leaves out the same ones).
std::vector<StreamExchange> stream_exchanges(const TieredPlan& plan, int ring,
                                             int rank);

// The most elements one reduce exchange of `rank` receives, over every
// ring: the scratch a stream needs per ring to receive before it reduces.
int64_t largest_reduce_receive(const TieredPlan& plan, int rank);

// Ring `ring`'s part of the buffer: its shard in the first phase, which a
// stream copies from input to output before the first exchange.
Span ring_part(const TieredPlan& plan, int ring);

}  // namespace jaxring
