// The TCP transport's handshake: who may open a connection to this process.
//
// Every process of a job holds the same secret (at least 128 bits; see
// jaxring/_src/distributed.py for where it comes from) and the job's id (16
// random bytes that process 0 makes for each job). A connection carries
// frames only after both ends proved they hold the secret, for this job, as
// the process indices they claim, by HMAC-SHA256 (OpenSSL) over both ends'
// fresh nonces:
//
//   connector -> acceptor  ConnectHello  magic, version, process, channel,
//                                        connector nonce (16 bytes)
//   acceptor -> connector  AcceptReply   magic, version, process, status,
//                                        acceptor nonce (16), acceptor MAC (32)
//   connector -> acceptor  ConnectProof  connector MAC (32)
//
// Integers are little-endian on the wire. A MAC covers a label naming its
// direction, the protocol version, the job id, both nonces, both process
// indices and the channel (see handshake_mac), so it cannot be replayed in
// another job, on another connection, or in the other direction. The
// acceptor answers a hello of another protocol version with its own version
// (status kWrongVersion) so that mixed builds are reported as such.
//
// What this does not do: encrypt. Anyone who can read the traffic can read
// the gradients, as with NCCL and Gloo by default.
#pragma once

#include <cstdint>
#include <string>

#include "cpu/net/socket_io.h"

namespace jaxring {

constexpr uint32_t kWireMagic = 0x4a52494e;  // "JRIN"
// Version 6: data frames carry a digest of the call's operand shapes
// (OpDesc::shape_digest). 5: after the handshake the connector offers a
// shared-memory ring (shm_link.h) and the acceptor answers. 4: data frames name
// their call's slot (OpDesc::slot_id). 3: the authenticated handshake. 2:
// unauthenticated hello.
constexpr uint32_t kProtocolVersion = 6;
constexpr size_t kNonceBytes = 16;
constexpr size_t kMacBytes = 32;
constexpr size_t kJobIdBytes = 16;
constexpr size_t kMinSecretBytes = 16;
constexpr size_t kMaxSecretBytes = 1024;
// One connection per ring; rings are at most 64 (ffi_common.h, kMaxRings).
constexpr int kMaxChannels = 64;

// What every process of one job shares, and which process this is.
struct JobIdentity {
  int process = -1;    // this process's index
  int processes = 0;   // how many the job has
  std::string secret;  // at least kMinSecretBytes
  std::string job_id;  // kJobIdBytes
};

// The library that authenticates peers ("OpenSSL 3.0.19 ..."), or "" when
// built with JAXRING_TCP_AUTH=OFF.
std::string tcp_auth_library();

// Why an identity cannot be used ("" if it can), including a build without
// authentication.
std::string identity_problem(const JobIdentity& id);

// Status an acceptor answers a hello with.
enum HandshakeStatus : int32_t {
  kHandshakeOk = 0,
  kWrongVersion = 1,    // the reply's version field says which it speaks
  kUnknownProcess = 2,  // the claimed process is not one of this job's
};

// Acceptor side: run on a freshly accepted socket. On success sets *process
// and *channel to what the connector proved. On failure sets *why (for
// counters and logs, never for the job's errors: a stranger chose it).
bool accept_handshake(int fd, const JobIdentity& me, Clock::time_point deadline,
                      int* process, int* channel, std::string* why);

// Connector side: proves this process to process `peer` on `channel` and
// checks that the acceptor is that process of this job. *error explains a
// failure to the user.
bool connect_handshake(int fd, const JobIdentity& me, int peer, int channel,
                       Clock::time_point deadline, std::string* error);

// libcrypto frees its global state (its locks, the random generator) in an
// atexit handler. A transport thread can be handshaking just then: when a
// peer exits first, this process reconnects to tell the others, and may be
// exiting itself. So the calls into libcrypto are counted, and
// close_handshakes(), called at interpreter exit before that handler runs,
// refuses handshakes from then on and waits up to timeout_s for the calls in
// flight; false if some were still running.
bool close_handshakes(double timeout_s);
bool handshakes_closed();

// The MAC one end sends. `from_acceptor` picks the label; the other fields
// are in the order the header comment gives. Exposed for tests.
std::string handshake_mac(const JobIdentity& me, bool from_acceptor,
                          const std::string& connector_nonce,
                          const std::string& acceptor_nonce,
                          int connector_process, int acceptor_process,
                          int channel);

}  // namespace jaxring
