// Blocking-style socket I/O with deadlines, for the TCP transport and its
// handshake: every wait is bounded, and nothing here knows the wire format.
//
// Sockets are used non-blocking (MSG_DONTWAIT) with short polls in between,
// so a thread never sleeps in the kernel past a deadline.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <functional>
#include <string>

#include "cpu/deadline.h"

namespace jaxring {

// Waits up to one poll slice (100 ms) for fd to be ready for `events`.
int poll_once(int fd, short events);

// Writes all of [data, data+n), advancing both. `stall_s` bounds the time
// without progress. `on_slice` runs between writes (it may redirect data to
// a private copy).
bool write_all(int fd, const char*& data, size_t& n, double stall_s,
               const std::function<void()>& on_slice, std::string* error);

// Writes what the socket takes now, without waiting, advancing data and n.
// False with *error only if the connection is broken.
bool write_now(int fd, const char*& data, size_t& n, std::string* error);

enum class ReadResult { kOk, kClosed, kError, kStalled };

// Reads exactly n bytes. idle_ok: waiting for the first byte has no limit
// (an idle connection between operations); after it, stall_s applies.
ReadResult read_exact(int fd, char* data, size_t n, bool idle_ok,
                      double stall_s, std::string* error);

// Reads exactly n bytes before `deadline`, however slowly they come: a peer
// that trickles a byte at a time cannot stretch it (kStalled when passed).
ReadResult read_exact_by(int fd, char* data, size_t n,
                         Clock::time_point deadline, std::string* error);

// TCP_NODELAY, keep-alives, and the buffer sizes set below, if any.
void tune_socket(int fd);

// The send and receive buffers (SO_SNDBUF, SO_RCVBUF) of every socket
// tune_socket sees from now on, in bytes; 0, the default, leaves them to
// the kernel's autotuning. A small buffer makes a socket take a large
// frame in parts (which the tests use to exercise that path).
void set_socket_buffer_bytes(int bytes);
int socket_buffer_bytes();

// Splits "host:port" or "[v6]:port".
bool split_address(const std::string& addr, std::string* host,
                   std::string* port);

// Connects to "host:port", retrying until timeout_s (the peer may still be
// starting its listener). Returns the socket, or -1 with *error set; when
// this process is out of descriptors or memory for a socket, at once, with
// an error that says so.
int connect_to(const std::string& addr, double timeout_s, std::string* error);

}  // namespace jaxring
