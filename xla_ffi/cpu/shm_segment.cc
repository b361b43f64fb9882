#include "shm_segment.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <cstring>

namespace jaxring {

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
  if (::getrandom(nonce.data(), nonce.size(), 0) != static_cast<ssize_t>(nonce.size())) {
    *error = "no random bytes for a shared-memory segment's name";
    return "";
  }
  return prefix + hex(nonce);
}

bool is_segment_name(const std::string& name, const std::string& prefix) {
  if (name.size() != prefix.size() + 32 || name.compare(0, prefix.size(), prefix) != 0) {
    return false;
  }
  for (size_t i = prefix.size(); i < name.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(name[i]);
    if (!std::isxdigit(c) || std::isupper(c)) return false;
  }
  return true;
}

void* create_segment(const std::string& name, size_t bytes, const std::string& what,
                     std::string* error) {
  const int fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) {
    *error = "cannot create " + name + " in /dev/shm: " + std::strerror(errno);
    return nullptr;
  }
  // Reserve every page now: a write to a page tmpfs cannot back is SIGBUS.
  const int rc = ::posix_fallocate(fd, 0, static_cast<off_t>(bytes));
  void* base = rc == 0 ? ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)
                       : MAP_FAILED;
  const int map_errno = errno;
  ::close(fd);
  if (base == MAP_FAILED) {
    ::shm_unlink(name.c_str());
    *error = rc != 0 ? "/dev/shm cannot hold " + std::to_string(bytes) + " bytes for " +
                           what + ": " + std::strerror(rc)
                     : "cannot map " + name + ": " + std::strerror(map_errno);
    return nullptr;
  }
  return base;
}

void* open_segment(const std::string& name, size_t min_bytes, const std::string& what,
                   size_t* bytes, std::string* error) {
  const int fd = ::shm_open(name.c_str(), O_RDWR | O_NOFOLLOW, 0);
  if (fd < 0) {
    *error = "cannot open " + name + " (is /dev/shm shared between the processes?): " +
             std::strerror(errno);
    return nullptr;
  }
  struct stat st{};
  void* base = MAP_FAILED;
  if (::fstat(fd, &st) != 0) {
    *error = "cannot stat " + what + ": " + std::strerror(errno);
  } else if (st.st_uid != ::geteuid() || (st.st_mode & 0777) != 0600 ||
             st.st_size < static_cast<off_t>(min_bytes)) {
    *error = what + " " + name + " is not this user's, not owner-only, or too small";
  } else {
    *bytes = static_cast<size_t>(st.st_size);
    base = ::mmap(nullptr, *bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (base == MAP_FAILED) *error = "cannot map " + what + ": " + std::strerror(errno);
  }
  ::close(fd);
  return base == MAP_FAILED ? nullptr : base;
}

}  // namespace jaxring
