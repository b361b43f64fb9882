// Making and mapping the job's POSIX shared-memory segments (the links'
// rings, shm_link.h, and the host segment, host_segment.h), one way for
// both: created O_EXCL and owner-only under a name nobody can guess, every
// page reserved up front, and mapped by a peer only if it is this user's,
// owner-only and named as the job names it.
#pragma once

#include <cstddef>
#include <string>

namespace jaxring {

// Lowercase hex of raw bytes (a job id, random bits).
std::string hex(const std::string& bytes);

// prefix followed by 32 hex digits of fresh random bits (128 bits: nobody
// can guess the name to squat on it); "" with *error if the kernel gave no
// random bytes.
std::string random_segment_name(const std::string& prefix, std::string* error);

// Whether name is what random_segment_name(prefix) makes.
bool is_segment_name(const std::string& name, const std::string& prefix);

// Creates the segment `name` (it must not exist) with mode 0600, reserves
// its `bytes` (a full /dev/shm refuses it here instead of killing the
// process with SIGBUS on a later write) and maps it, zero-filled. nullptr
// with *error, the name removed again; `what` names the segment there.
void* create_segment(const std::string& name, size_t bytes, const std::string& what,
                     std::string* error);

// Maps the existing segment `name`, which must be this user's, owner-only
// and of at least min_bytes; *bytes is its size. nullptr with *error.
void* open_segment(const std::string& name, size_t min_bytes, const std::string& what,
                   size_t* bytes, std::string* error);

}  // namespace jaxring
