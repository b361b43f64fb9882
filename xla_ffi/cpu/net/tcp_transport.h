// TCP transport: executes a RingPlan among ranks that live in different
// processes (multi-controller JAX, jax.distributed), for the CPU backend.
//
// Why it looks the way it does:
//  * The listening port is reachable by anyone, so a connection carries
//    frames only once both ends proved that they belong to the job
//    (tcp_handshake.h), and it then speaks for the process it proved: a
//    frame's source rank must run there. What frames can make this process
//    hold is bounded by its own plan and fixed caps, never by the frame.
//  * One TCP connection per (destination process, ring), opened on first use
//    and kept for the life of the process. Rings get their own connections so
//    several rings are on the wire at once, and odd rings run the other way
//    round, so both directions of a full-duplex link carry data.
//  * Every frame carries the operation's identity and description (dtype,
//    count, op, world size, rings, chunk size). A receiver checks it against
//    its own call, so ranks that disagree get an error naming both versions,
//    on every rank (the detecting rank tells the others with an abort frame),
//    instead of garbage.
//  * Independent allreduces may start in different orders on different
//    processes, so frames are matched to operations by identity (run id, op
//    id, group), never by arrival order. Data for an operation this process
//    has not reached yet is held until it does; once it has, frames are
//    received straight into the destination buffer.
//  * As in the in-process transport, the FFI handler returns an ffi::Future;
//    a worker thread per device reduces each chunk while the next is on the
//    wire, and each device's future is completed by its own worker.
//  * A peer that dies closes its sockets: every operation that needs it fails
//    at once, naming it. A peer that stops responding is caught by the
//    operation's deadline. No wait is unbounded.
//  * Ranks of the same group inside one process (several virtual devices per
//    process) hand chunks to each other in memory through the same path, so a
//    ring may cross both kinds of link.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "cpu/operation.h"
#include "cpu/net/tcp_handshake.h"

namespace jaxring {

// Opens this process's listening socket on bind_host (a free port), for the
// job `identity` names: a connection is let in only once it proved that it
// comes from another process of that job (tcp_handshake.h). Returns the
// port, or -1 with *error set. Calling it again returns the same port.
// use_shm: whether this process offers and takes shared-memory rings
// (shm_link.h) with processes on its host. It is fixed here, before the
// first connection can arrive: a peer may connect, and offer a ring, as soon
// as it knows the port, before this process's tcp_set_peers has run.
int tcp_listen(const std::string& bind_host, const JobIdentity& identity,
               bool use_shm, std::string* error);

// Tells the transport where every process listens ("host:port", indexed by
// process), and which processes run on this host: with tcp_listen's use_shm,
// data to and from those goes through shared-memory rings wherever both
// ends can map them. Call once after tcp_listen; false with *error on a bad
// table.
bool tcp_set_peers(const std::vector<std::string>& addresses,
                   const std::vector<int>& same_host, std::string* error);

// Starts `rank`'s part of an allreduce whose ranks run in the processes
// process_of_rank[0..world). Same contract as inprocess_allreduce: `in` and
// `out` stay valid until `done` is called, exactly once.
void tcp_allreduce(const OpKey& key, const OpDesc& desc, int rank, int device,
                   const std::vector<int>& process_of_rank, const void* in,
                   void* out, double timeout_s, Completion done);

// Operations currently held by the transport (for tests: must drop to 0).
int64_t tcp_pending_ops();

// What an operator needs to see of the transport.
struct TcpTransportInfo {
  bool listening = false;
  std::string host;  // as given to tcp_listen
  int port = -1;
  int process = -1;
  int processes = 0;
  std::string job_id;  // raw bytes
  uint32_t protocol_version = kProtocolVersion;
  std::string auth_library;  // "" when built without authentication
  // Authenticated connections: (process, channel) in and out.
  std::vector<std::pair<int, int>> inbound, outbound;
  // Those of them whose data goes through a shared-memory ring, the
  // processes taken to share this host, whether rings are used at all,
  // and why one could not be made or mapped here ("" if none failed).
  std::vector<std::pair<int, int>> shm_inbound, shm_outbound;
  std::vector<int> same_host;
  bool use_shm = false;
  std::string shm_unavailable;
  // Data frames sent so far, written by the thread that sent them (a
  // device's worker) and (wholly or in part) by the connections' sender
  // threads (OutLink::send_data says which writes which).
  int64_t data_frames_by_device_thread = 0;
  int64_t data_frames_by_sender_thread = 0;
  // Of the latter, frames a device's worker began (part of them on the
  // socket, or their payload in the ring) and the sender thread finished.
  int64_t data_frames_finished_by_sender_thread = 0;
  std::vector<int> lost_processes;
  int64_t refused_connections = 0;
  std::string last_refusal;  // why the last one was refused
  int64_t pending_ops = 0;
};
TcpTransportInfo tcp_transport_info();

}  // namespace jaxring
