// NCCL communicators, one per (ring, rank of a device group), created on
// first use and cached for the life of the process.
//
// The Python side names each communicator by its NCCL unique id, made once
// per (group of devices, ring) and, across processes, published by the
// process of the group's rank 0 through jax.distributed's key-value store.
// The same id therefore reaches every rank's custom call as an attribute,
// and each rank's first call joins the communicator.
//
// Communicators are nonblocking (ncclConfig_t.blocking = 0): joining, and
// enqueueing work, return at once and are polled until ready with the
// operation's timeout, so a peer that never arrives gives an error instead
// of a hang, and the communicator is aborted. An aborted communicator stays
// in the cache, marked, so that later calls fail fast saying so.
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>

#include <array>
#include <cstdint>
#include <mutex>
#include <string>

#include "checks.h"

namespace jaxring::cuda {

struct Communicator {
  ncclComm_t comm = nullptr;
  cudaStream_t stream = nullptr;  // the ring's stream on `device`
  cudaEvent_t fork = nullptr;     // XLA's stream -> the ring's stream
  cudaEvent_t join = nullptr;     // the ring's stream -> XLA's stream
  int device = -1;
  int rank = -1;
  int world_size = 0;
  // Held while enqueueing: NCCL communicators are not thread-safe, and two
  // executions may call on one device from different threads.
  std::mutex mu;
  // 1 once aborted, in pinned host memory that kernels read through
  // abort_flag_device (watchdog.h).
  volatile int* abort_flag_host = nullptr;
  const int* abort_flag_device = nullptr;
  bool ready = false;  // joined, with its stream and events
  bool aborted = false;
  std::string abort_reason;
};

// A 128-byte ncclUniqueId as it travels in the custom call's attribute.
using UniqueIdBytes = std::array<char, NCCL_UNIQUE_ID_BYTES>;

// A fresh id (ncclGetUniqueId: host only, no device needed).
Status new_unique_id(UniqueIdBytes* out);

// The communicator of (id, rank) on `device`, joined with the peers on
// first use (waiting at most timeout_s for them). The pointer stays valid
// until destroy_communicators().
Status communicator_for(const UniqueIdBytes& id, int world_size, int rank,
                        int device, double timeout_s, Communicator** out);

// Waits until the communicator has no NCCL call in progress (nonblocking
// communicators finish enqueueing in the background), at most timeout_s;
// on a timeout or an asynchronous error, aborts it.
Status wait_ready(Communicator* c, double timeout_s, const char* what);

// Marks c aborted, sets its abort flag and aborts its NCCL communicator
// (c->mu must be held).
void abort_communicator(Communicator* c, const std::string& why);

// The error for a call on an aborted communicator (c->mu held).
std::string aborted_error(const Communicator* c);

// Finalizes and destroys every cached communicator (atexit, from Python,
// while CUDA is still up). Returns how many were destroyed.
int destroy_communicators();

// Communicators in the cache, for tests and build_info.
int communicator_count();

}  // namespace jaxring::cuda
