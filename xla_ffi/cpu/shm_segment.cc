#include "cpu/shm_segment.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <mutex>

namespace jaxring {

namespace {

// The names this process created and has not unlinked yet, for the exit
// handlers. A signal handler reads them, so there is no lock: a slot's
// state word says whether its name is armed, and moves to a new generation
// whenever the slot is freed, so a handler that copied a name while the
// slot was rewritten sees the word change and skips it. A process creates
// a few segments at a time (its links' rings while it connects, then the
// host segment); a name that finds no free slot is left to
// remove_stale_segments.
constexpr int kExitSlots = 256;
constexpr size_t kExitNameBytes = 128;
enum : uint64_t { kSlotFree = 0, kSlotWriting = 1, kSlotArmed = 2 };
struct ExitSlot {
  std::atomic<uint64_t> state;  // bits 0-1: kSlot*; the rest: generation
  std::atomic<int32_t> pid;     // the creator: a forked child removes nothing
  std::atomic<char> name[kExitNameBytes];
};
ExitSlot g_exit_slots[kExitSlots];
static_assert(std::atomic<uint64_t>::is_always_lock_free &&
                  std::atomic<int32_t>::is_always_lock_free &&
                  std::atomic<char>::is_always_lock_free,
              "the exit handlers read the slots in a signal handler");

// What SIGTERM and SIGINT did before jaxring's handler, which chains to it.
struct sigaction g_previous_term, g_previous_int;

// Async-signal-safe: unlink(2) of "/dev/shm" followed by the name (what
// shm_unlink does, without its set-up), and no allocation.
void unlink_armed() {
  const int32_t me = static_cast<int32_t>(::getpid());
  for (ExitSlot& slot : g_exit_slots) {
    const uint64_t s = slot.state.load(std::memory_order_acquire);
    if ((s & 3) != kSlotArmed || slot.pid.load(std::memory_order_relaxed) != me)
      continue;
    char path[sizeof("/dev/shm") + kExitNameBytes];
    std::memcpy(path, "/dev/shm", sizeof("/dev/shm") - 1);
    for (size_t i = 0; i < kExitNameBytes; ++i) {
      path[sizeof("/dev/shm") - 1 + i] =
          slot.name[i].load(std::memory_order_relaxed);
    }
    path[sizeof(path) - 1] = '\0';
    std::atomic_thread_fence(std::memory_order_acquire);
    if (slot.state.load(std::memory_order_relaxed) != s)
      continue;  // rewritten meanwhile
    ::unlink(path);
  }
}

void on_exit_signal(int sig, siginfo_t* info, void* context) {
  const int saved_errno = errno;
  unlink_armed();
  errno = saved_errno;
  const struct sigaction& previous =
      sig == SIGTERM ? g_previous_term : g_previous_int;
  if (previous.sa_flags & SA_SIGINFO) {
    previous.sa_sigaction(sig, info, context);
  } else if (previous.sa_handler == SIG_DFL) {
    // The default action ends the process: restored, and the signal raised
    // again, delivered as this handler returns.
    struct sigaction dfl{};
    dfl.sa_handler = SIG_DFL;
    sigemptyset(&dfl.sa_mask);
    ::sigaction(sig, &dfl, nullptr);
    ::raise(sig);
  } else if (previous.sa_handler != SIG_IGN) {
    previous.sa_handler(sig);
  }
}

// Chains in front of whatever handles the signal now (JAX's preemption
// notice takes SIGTERM and keeps the process running until the launcher's
// SIGKILL; Python's handler turns SIGINT into KeyboardInterrupt), with its
// flags, so that nothing else changes. An ignored signal stays ignored
// (and so for the programs this process execs). A handler installed later
// replaces this one: its names are then left to remove_stale_segments.
void chain_handler(int sig, struct sigaction* previous) {
  if (::sigaction(sig, nullptr, previous) != 0) return;
  if (!(previous->sa_flags & SA_SIGINFO) && previous->sa_handler == SIG_IGN)
    return;
  struct sigaction mine = *previous;
  mine.sa_sigaction = on_exit_signal;
  mine.sa_flags = previous->sa_flags | SA_SIGINFO;
  ::sigaction(sig, &mine, nullptr);
}

void install_exit_handlers() {
  static std::once_flag once;
  std::call_once(once, [] {
    chain_handler(SIGTERM, &g_previous_term);
    chain_handler(SIGINT, &g_previous_int);
    std::atexit(unlink_armed);
  });
}

void arm(const std::string& name) {
  if (name.size() >= kExitNameBytes) return;
  install_exit_handlers();
  for (ExitSlot& slot : g_exit_slots) {
    uint64_t s = slot.state.load();
    if ((s & 3) != kSlotFree ||
        !slot.state.compare_exchange_strong(s, s | kSlotWriting)) {
      continue;
    }
    slot.pid.store(static_cast<int32_t>(::getpid()), std::memory_order_relaxed);
    for (size_t i = 0; i < kExitNameBytes; ++i) {
      slot.name[i].store(i < name.size() ? name[i] : '\0',
                         std::memory_order_relaxed);
    }
    slot.state.store(s | kSlotArmed, std::memory_order_release);
    return;
  }
}

void disarm(const std::string& name) {
  if (name.size() >= kExitNameBytes) return;  // never armed
  for (ExitSlot& slot : g_exit_slots) {
    const uint64_t s = slot.state.load();
    if ((s & 3) != kSlotArmed) continue;
    size_t i = 0;
    while (i < name.size() &&
           slot.name[i].load(std::memory_order_relaxed) == name[i])
      ++i;
    if (i < name.size() || slot.name[i].load(std::memory_order_relaxed) != '\0')
      continue;
    slot.state.store(((s >> 2) + 1) << 2 | kSlotFree,
                     std::memory_order_release);
    return;
  }
}

}  // namespace

std::string hex(const std::string& bytes) {
  static const char digits[] = "0123456789abcdef";
  std::string out;
  for (unsigned char c : bytes) {
    out += digits[c >> 4];
    out += digits[c & 15];
  }
  return out;
}

std::string random_segment_name(const std::string& prefix, std::string* error) {
  std::string nonce(16, '\0');
  if (::getrandom(nonce.data(), nonce.size(), 0) !=
      static_cast<ssize_t>(nonce.size())) {
    *error = "no random bytes for a shared-memory segment's name";
    return "";
  }
  return prefix + hex(nonce);
}

bool is_segment_name(const std::string& name, const std::string& prefix) {
  if (name.size() != prefix.size() + 32 ||
      name.compare(0, prefix.size(), prefix) != 0) {
    return false;
  }
  for (size_t i = prefix.size(); i < name.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(name[i]);
    if (!std::isxdigit(c) || std::isupper(c)) return false;
  }
  return true;
}

void* create_segment(const std::string& name, size_t bytes,
                     const std::string& what, std::string* error) {
  // Armed first: a signal right after the file appears finds its name.
  arm(name);
  const int fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) {
    disarm(name);
    *error = "cannot create " + name + " in /dev/shm: " + std::strerror(errno);
    return nullptr;
  }
  // Reserve every page now: a write to a page tmpfs cannot back is SIGBUS.
  const int rc = ::posix_fallocate(fd, 0, static_cast<off_t>(bytes));
  void* base = rc == 0 ? ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                                MAP_SHARED, fd, 0)
                       : MAP_FAILED;
  const int map_errno = errno;
  ::close(fd);
  if (base == MAP_FAILED) {
    unlink_segment(name);
    *error = rc != 0 ? "/dev/shm cannot hold " + std::to_string(bytes) +
                           " bytes for " + what + ": " + std::strerror(rc)
                     : "cannot map " + name + ": " + std::strerror(map_errno);
    return nullptr;
  }
  return base;
}

void unlink_segment(const std::string& name) {
  ::shm_unlink(name.c_str());
  disarm(name);
}

void* open_segment(const std::string& name, size_t min_bytes,
                   const std::string& what, size_t* bytes, std::string* error) {
  const int fd = ::shm_open(name.c_str(), O_RDWR | O_NOFOLLOW, 0);
  if (fd < 0) {
    *error =
        "cannot open " + name +
        " (is /dev/shm shared between the processes?): " + std::strerror(errno);
    return nullptr;
  }
  struct stat st{};
  void* base = MAP_FAILED;
  if (::fstat(fd, &st) != 0) {
    *error = "cannot stat " + what + ": " + std::strerror(errno);
  } else if (st.st_uid != ::geteuid() || (st.st_mode & 0777) != 0600 ||
             st.st_size < static_cast<off_t>(min_bytes)) {
    *error =
        what + " " + name + " is not this user's, not owner-only, or too small";
  } else {
    *bytes = static_cast<size_t>(st.st_size);
    base = ::mmap(nullptr, *bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (base == MAP_FAILED)
      *error = "cannot map " + what + ": " + std::strerror(errno);
  }
  ::close(fd);
  return base == MAP_FAILED ? nullptr : base;
}

uint64_t pid_namespace() {
  struct stat st{};
  return ::stat("/proc/self/ns/pid", &st) == 0
             ? static_cast<uint64_t>(st.st_ino)
             : 0;
}

std::vector<std::string> remove_stale_segments(
    const std::vector<SegmentReader>& readers) {
  std::vector<std::string> removed;
  const uint64_t ns = pid_namespace();
  if (ns == 0) return removed;  // no pid written here can be told gone
  DIR* dir = ::opendir("/dev/shm");
  if (dir == nullptr) return removed;
  const int dir_fd = ::dirfd(dir);
  alignas(64) char head[kSegmentHeadBytes];
  while (const dirent* e = ::readdir(dir)) {
    if (std::strncmp(e->d_name, "jaxring-", 8) != 0) continue;
    const std::string name = std::string("/") + e->d_name;
    // Read, not mapped: a file cut short meanwhile cannot raise SIGBUS here.
    const int fd = ::openat(dir_fd, e->d_name,
                            O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) continue;
    struct stat st{};
    SegmentCreator creator;
    bool known = false;
    if (::fstat(fd, &st) == 0 && S_ISREG(st.st_mode) &&
        st.st_uid == ::geteuid() && (st.st_mode & 0777) == 0600 &&
        st.st_size >= static_cast<off_t>(kSegmentHeadBytes) &&
        ::pread(fd, head, kSegmentHeadBytes, 0) ==
            static_cast<ssize_t>(kSegmentHeadBytes)) {
      for (const SegmentReader& read : readers) {
        if (read(name, head, static_cast<size_t>(st.st_size), &creator)) {
          known = true;
          break;
        }
      }
    }
    ::close(fd);
    // kill(pid, 0) succeeds for a live process (and a zombie: its parent
    // may still act for it) and fails with EPERM for another user's: only
    // ESRCH says that no process has the pid. A creator whose pid was
    // reused keeps its segment: rare, and never wrong.
    if (known && creator.pid > 0 && creator.pid_namespace == ns &&
        ::kill(creator.pid, 0) != 0 && errno == ESRCH &&
        ::unlinkat(dir_fd, e->d_name, 0) == 0) {
      removed.push_back(name);
    }
  }
  ::closedir(dir);
  return removed;
}

}  // namespace jaxring
