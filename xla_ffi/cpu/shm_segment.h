// Making and mapping the job's POSIX shared-memory segments (the links'
// rings, shm_link.h, and the host segment, host_segment.h), one way for
// both: created O_EXCL and owner-only under a name nobody can guess, every
// page reserved up front, and mapped by a peer only if it is this user's,
// owner-only and named as the job names it.
//
// A name stays in /dev/shm only until the peers mapped the segment. Until
// its creator unlinks it (unlink_segment), the name is also removed by
// every way out of the creator that runs any code: a C++ error unwinds the
// segment's owner, jaxring/_src/host_segment.py abandons the host segment
// on a Python exception, and SIGTERM, SIGINT and exit() reach the handlers
// create_segment installs (chained in front of the process's own; a signal
// it ignores stays ignored, and a handler it installs later replaces
// jaxring's). A creator killed outright (SIGKILL, a crash) leaves its
// names; remove_stale_segments, run by every later job of the user on the
// host that uses shared memory, removes those whose creator is gone.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

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
void* create_segment(const std::string& name, size_t bytes,
                     const std::string& what, std::string* error);

// Removes the name of a segment this process created (idempotent) and
// stops the exit handlers from removing it. The mappings stay valid.
void unlink_segment(const std::string& name);

// Maps the existing segment `name`, which must be this user's, owner-only
// and of at least min_bytes; *bytes is its size. nullptr with *error.
void* open_segment(const std::string& name, size_t min_bytes,
                   const std::string& what, size_t* bytes, std::string* error);

// The inode of this process's pid namespace (0 if unknown): pids written
// by a process in another namespace name other processes here.
uint64_t pid_namespace();

// Who created a segment: written into it before its name is published.
struct SegmentCreator {
  int32_t pid = 0;
  uint64_t pid_namespace = 0;
};

// Recognizes a segment ("/jaxring-...") from a copy of its first
// kSegmentHeadBytes (aligned to 64) and the file's size: true with
// *creator only if it is a segment of this build, laid out whole, whose
// creator's pid is written.
using SegmentReader =
    std::function<bool(const std::string& name, const char* head,
                       size_t file_bytes, SegmentCreator* creator)>;
constexpr size_t kSegmentHeadBytes = 8192;

// Removes from /dev/shm the jaxring segments ("jaxring-*") that a previous
// job left: only those of this user, owner-only, that one of `readers`
// recognizes, whose creator ran in this pid namespace and is gone
// (kill(pid, 0) says ESRCH). A segment whose creator is alive (a job being
// set up now) or unknown, or that nobody here recognizes, stays. Returns
// the names removed ("/jaxring-...").
std::vector<std::string> remove_stale_segments(
    const std::vector<SegmentReader>& readers);

}  // namespace jaxring
