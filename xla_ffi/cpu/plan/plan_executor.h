// The plan executor: runs each local rank's part of a tiered plan
// (tiered_plan.h; a flat ring is one tier) on a worker thread per device.
//
// The executor knows three things about moving data: a unit to a rank of
// this process is written into that rank's result in memory (or staged if
// the rank cannot take it yet), a unit to a rank of another process goes to
// the operation's host (OpHost::send_remote: the TCP transport), and a unit
// that has arrived is reduced into (or stored as) the receiver's result. So
// the same schedule, and the same summation order, runs whether a ring
// crosses processes or stays in one.
//
// Why a worker thread per device: XLA CPU runs device programs on a shared
// pool, and a handler that blocks on its peers would hold a pool thread.
// The handler hands its rank to the device's worker and returns a future,
// which that worker completes (a future's continuation runs on the thread
// that completes it, so each device continues on its own thread).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "cpu/operation.h"
#include "cpu/plan/plan_op.h"

namespace jaxring {

// The worker thread of one device (created on first use, never destroyed:
// XLA may still run a program during interpreter shutdown).
PlanWorker* plan_worker(int device);
// Tells a worker that something it may wait for has happened.
void wake(PlanWorker* worker);

// Registers `rank` (running on `device`, in process `me` of
// process_of_rank) as a local rank of op. Requires op.mu. Returns "" on
// success, else the tagged error of why this rank cannot join; *fails_all
// then says whether the operation must fail for every rank too (its ranks
// disagree), rather than only this call.
std::string join_rank(PlanOp& op, const OpDesc& desc, int rank, int device,
                      int me, const std::vector<int>& process_of_rank,
                      const void* in, void* out, double timeout_s,
                      bool* fails_all);

// Hands a joined rank to its device's worker, which runs it and calls done
// exactly once. Requires op.mu not held.
void run_rank(std::shared_ptr<PlanOp> op, int rank, Completion done);

}  // namespace jaxring
