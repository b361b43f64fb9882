// What kind of failure an allreduce met, carried in its message.
//
// Every failure message a jaxring handler returns starts with a tag such as
// "[jaxring kind=peer_lost peer=1] ", written where the failure is found.
// The handler picks the XLA status from it (UNAVAILABLE for a lost peer,
// DEADLINE_EXCEEDED for a timeout, FAILED_PRECONDITION for a mismatch,
// INVALID_ARGUMENT, RESOURCE_EXHAUSTED, INTERNAL), and jaxring/_src/errors.py
// the exception type and peer_process; nothing is guessed from prose. A
// failure that another process reports travels as an abort frame whose
// header carries its kind and peer as numbers; the receiver writes its own
// tag from those and keeps the sender's words only as text.
#pragma once

#include <string>

namespace jaxring {

enum class FailureKind : int {
  kInternal = 0,  // a bug, or a state jaxring does not expect
  kPeerLost = 1,  // a process of the job left or cannot be reached
  kTimeout = 2,   // a peer did not send within timeout_s
  kMismatch = 3,  // ranks or processes run different allreduces/programs
  kInvalid = 4,   // the call itself cannot run (bad attributes, set-up)
  kResource = 5,  // this process is out of memory, descriptors or slots
};
constexpr int kNumFailureKinds = 6;

// "peer_lost", "timeout", ...
const char* failure_kind_name(FailureKind kind);

// `message` with the tag in front; peer is a process index, or -1.
std::string tagged(FailureKind kind, int peer, const std::string& message);

// Reads the tag at the start of `message`: its kind and peer, and the text
// after it. False (and *rest = message) when it has none.
bool parse_tag(const std::string& message, FailureKind* kind, int* peer,
               std::string* rest);

}  // namespace jaxring
