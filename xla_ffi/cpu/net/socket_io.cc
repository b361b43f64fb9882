#include "cpu/net/socket_io.h"

#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <sstream>
#include <thread>

namespace jaxring {

namespace {
constexpr int kPollSliceMs = 100;

#if defined(__SANITIZE_THREAD__)
#define JAXRING_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define JAXRING_TSAN 1
#endif
#endif
#ifdef JAXRING_TSAN
extern "C" void AnnotateIgnoreReadsBegin(const char* file, int line);
extern "C" void AnnotateIgnoreReadsEnd(const char* file, int line);
#endif

// send() with its read of the buffer hidden from ThreadSanitizer. A chunk
// sent from a result buffer travels round the ring through other processes
// and comes back as the reduced chunk that overwrites the same bytes. That
// order is real (the bytes had left before the ring could go on), but TSan
// sees no happens-before through another process, and reports the race when
// the sending thread is descheduled between send() returning and its next
// lock. AddressSanitizer still checks that the buffer is valid.
ssize_t send_some(int fd, const char* data, size_t n) {
#ifdef JAXRING_TSAN
  AnnotateIgnoreReadsBegin(__FILE__, __LINE__);
#endif
  const ssize_t w = ::send(fd, data, n, MSG_NOSIGNAL | MSG_DONTWAIT);
#ifdef JAXRING_TSAN
  AnnotateIgnoreReadsEnd(__FILE__, __LINE__);
#endif
  return w;
}

}  // namespace

int poll_once(int fd, short events) {
  pollfd p{fd, events, 0};
  return ::poll(&p, 1, kPollSliceMs);
}

bool write_all(int fd, const char*& data, size_t& n, double stall_s,
               const std::function<void()>& on_slice, std::string* error) {
  auto stall_deadline = after_seconds(stall_s);
  while (n > 0) {
    if (on_slice) on_slice();
    const ssize_t w = send_some(fd, data, n);
    if (w > 0) {
      data += w;
      n -= static_cast<size_t>(w);
      stall_deadline = after_seconds(stall_s);
      continue;
    }
    if (w < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
      *error = std::string("send failed: ") + std::strerror(errno);
      return false;
    }
    if (Clock::now() > stall_deadline) {
      std::ostringstream os;
      os << "the peer accepted no data for " << stall_s << " s";
      *error = os.str();
      return false;
    }
    poll_once(fd, POLLOUT);
  }
  return true;
}

bool write_now(int fd, const char*& data, size_t& n, std::string* error) {
  while (n > 0) {
    const ssize_t w = send_some(fd, data, n);
    if (w > 0) {
      data += w;
      n -= static_cast<size_t>(w);
      continue;
    }
    if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return true;
    if (w < 0 && errno == EINTR) continue;
    *error = std::string("send failed: ") + std::strerror(errno);
    return false;
  }
  return true;
}

ReadResult read_exact(int fd, char* data, size_t n, bool idle_ok,
                      double stall_s, std::string* error) {
  auto stall_deadline = after_seconds(stall_s);
  bool started = !idle_ok;
  while (n > 0) {
    const ssize_t r = ::recv(fd, data, n, MSG_DONTWAIT);
    if (r > 0) {
      data += r;
      n -= static_cast<size_t>(r);
      started = true;
      stall_deadline = after_seconds(stall_s);
      continue;
    }
    if (r == 0) {
      *error = "the connection was closed (did the process exit?)";
      return ReadResult::kClosed;
    }
    if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
      *error = std::string("recv failed: ") + std::strerror(errno);
      return ReadResult::kError;
    }
    if (started && Clock::now() > stall_deadline) {
      std::ostringstream os;
      os << "the peer sent nothing for " << stall_s << " s in mid-frame";
      *error = os.str();
      return ReadResult::kStalled;
    }
    poll_once(fd, POLLIN);
  }
  return ReadResult::kOk;
}

ReadResult read_exact_by(int fd, char* data, size_t n,
                         Clock::time_point deadline, std::string* error) {
  while (n > 0) {
    const ssize_t r = ::recv(fd, data, n, MSG_DONTWAIT);
    if (r > 0) {
      data += r;
      n -= static_cast<size_t>(r);
      continue;
    }
    if (r == 0) {
      *error = "the connection was closed";
      return ReadResult::kClosed;
    }
    if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
      *error = std::string("recv failed: ") + std::strerror(errno);
      return ReadResult::kError;
    }
    if (Clock::now() > deadline) {
      *error = "the peer did not send in time";
      return ReadResult::kStalled;
    }
    poll_once(fd, POLLIN);
  }
  return ReadResult::kOk;
}

namespace {
std::atomic<int> g_socket_buffer_bytes{0};
}  // namespace

void set_socket_buffer_bytes(int bytes) { g_socket_buffer_bytes.store(bytes); }
int socket_buffer_bytes() { return g_socket_buffer_bytes.load(); }

void tune_socket(int fd) {
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  ::setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
  const int bytes = g_socket_buffer_bytes.load();
  if (bytes > 0) {
    ::setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &bytes, sizeof(bytes));
    ::setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &bytes, sizeof(bytes));
  }
}

bool split_address(const std::string& addr, std::string* host,
                   std::string* port) {
  const size_t colon = addr.rfind(':');
  if (colon == std::string::npos) return false;
  *host = addr.substr(0, colon);
  *port = addr.substr(colon + 1);
  if (host->size() > 2 && host->front() == '[' && host->back() == ']') {
    *host = host->substr(1, host->size() - 2);
  }
  return !host->empty() && !port->empty();
}

int connect_to(const std::string& addr, double timeout_s, std::string* error) {
  std::string host, port;
  if (!split_address(addr, &host, &port)) {
    *error = "bad address '" + addr + "' (want host:port)";
    return -1;
  }
  const auto deadline = after_seconds(timeout_s);
  for (;;) {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* res = nullptr;
    const int rc = ::getaddrinfo(host.c_str(), port.c_str(), &hints, &res);
    if (rc == 0) {
      for (addrinfo* ai = res; ai; ai = ai->ai_next) {
        const int fd =
            ::socket(ai->ai_family, ai->ai_socktype, ai->ai_protocol);
        if (fd < 0) {
          if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS ||
              errno == ENOMEM) {
            // This process's fault, not the peer's: say so, and stop.
            *error = std::string("this process cannot open a socket: ") +
                     std::strerror(errno) + " (raise its limit: ulimit -n)";
            ::freeaddrinfo(res);
            return -1;
          }
          continue;
        }
        tune_socket(fd);  // before connecting: the buffers size the window
        if (::connect(fd, ai->ai_addr, ai->ai_addrlen) == 0) {
          ::freeaddrinfo(res);
          return fd;
        }
        *error =
            std::string("connect to ") + addr + ": " + std::strerror(errno);
        ::close(fd);
      }
      ::freeaddrinfo(res);
    } else {
      *error = std::string("resolve ") + addr + ": " + ::gai_strerror(rc);
    }
    if (Clock::now() > deadline) return -1;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

}  // namespace jaxring
