#include "cpu/net/tcp_handshake.h"

#ifdef JAXRING_TCP_AUTH
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>
#endif

#include <atomic>
#include <chrono>
#include <sstream>
#include <thread>

namespace jaxring {

namespace {

std::atomic<bool> g_handshakes_closed{false};
std::atomic<int> g_crypto_calls{0};

// One use of libcrypto's global state; allowed() is false once handshakes
// are closed (close_handshakes counts on this order: count first, then look).
class CryptoCall {
 public:
  CryptoCall() {
    g_crypto_calls.fetch_add(1);
    allowed_ = !g_handshakes_closed.load();
  }
  ~CryptoCall() { g_crypto_calls.fetch_sub(1); }
  CryptoCall(const CryptoCall&) = delete;
  CryptoCall& operator=(const CryptoCall&) = delete;
  bool allowed() const { return allowed_; }

 private:
  bool allowed_;
};

constexpr const char* kClosedError =
    "this process is exiting: jaxring opens no new connections";

constexpr size_t kHelloBytes = 8 + 4 + 4 + kNonceBytes;
constexpr size_t kReplyBytes = 8 + 4 + 4 + kNonceBytes + kMacBytes;
static_assert(kHelloBytes == 32 && kReplyBytes == 64, "handshake layout");

void put_u32(std::string* out, uint32_t v) {
  for (int i = 0; i < 4; ++i)
    out->push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

uint32_t get_u32(const char* p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i)
    v |= static_cast<uint32_t>(static_cast<uint8_t>(p[i])) << (8 * i);
  return v;
}

int32_t get_i32(const char* p) { return static_cast<int32_t>(get_u32(p)); }

bool fresh_nonce(std::string* nonce) {
  nonce->assign(kNonceBytes, '\0');
#ifdef JAXRING_TCP_AUTH
  CryptoCall call;
  if (!call.allowed()) return false;
  return RAND_bytes(reinterpret_cast<unsigned char*>(nonce->data()),
                    static_cast<int>(kNonceBytes)) == 1;
#else
  return false;
#endif
}

bool send_bytes(int fd, const std::string& bytes, Clock::time_point deadline,
                std::string* error) {
  const char* p = bytes.data();
  size_t n = bytes.size();
  const double left =
      std::chrono::duration<double>(deadline - Clock::now()).count();
  return write_all(fd, p, n, left > 0 ? left : 0.0, nullptr, error);
}

std::string reply(const JobIdentity& me, HandshakeStatus status,
                  const std::string& nonce, const std::string& mac) {
  std::string out;
  put_u32(&out, kWireMagic);
  put_u32(&out, kProtocolVersion);
  put_u32(&out, static_cast<uint32_t>(me.process));
  put_u32(&out, static_cast<uint32_t>(status));
  out += nonce.empty() ? std::string(kNonceBytes, '\0') : nonce;
  out += mac.empty() ? std::string(kMacBytes, '\0') : mac;
  return out;
}

// In constant time: how much of a MAC matched must not show in the timing.
bool same_bytes(const std::string& a, const std::string& b) {
#ifdef JAXRING_TCP_AUTH
  return a.size() == b.size() &&
         CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
#else
  (void)a;
  (void)b;
  return false;
#endif
}

}  // namespace

bool close_handshakes(double timeout_s) {
  g_handshakes_closed.store(true);
  const auto until = std::chrono::steady_clock::now() +
                     std::chrono::duration<double>(timeout_s);
  while (g_crypto_calls.load() > 0) {
    if (std::chrono::steady_clock::now() >= until) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

bool handshakes_closed() { return g_handshakes_closed.load(); }

std::string tcp_auth_library() {
#ifdef JAXRING_TCP_AUTH
  return OpenSSL_version(OPENSSL_VERSION);
#else
  return "";
#endif
}

std::string identity_problem(const JobIdentity& id) {
  std::ostringstream os;
  if (tcp_auth_library().empty()) {
    os << "this jaxring was built without OpenSSL (JAXRING_TCP_AUTH=OFF), and "
          "its TCP transport lets no peer in without authentication; rebuild "
          "with OpenSSL's headers installed (e.g. apt-get install libssl-dev)";
  } else if (id.processes < 1 || id.process < 0 || id.process >= id.processes) {
    os << "process index " << id.process << " is not one of " << id.processes;
  } else if (id.secret.size() < kMinSecretBytes ||
             id.secret.size() > kMaxSecretBytes) {
    os << "the job secret has " << id.secret.size() << " bytes; it needs "
       << kMinSecretBytes << " to " << kMaxSecretBytes;
  } else if (id.job_id.size() != kJobIdBytes) {
    os << "the job id has " << id.job_id.size() << " bytes, not "
       << kJobIdBytes;
  }
  return os.str();
}

std::string handshake_mac(const JobIdentity& me, bool from_acceptor,
                          const std::string& connector_nonce,
                          const std::string& acceptor_nonce,
                          int connector_process, int acceptor_process,
                          int channel) {
  std::string msg(from_acceptor ? "jaxring accept" : "jaxring connect");
  msg.resize(16, '\0');
  put_u32(&msg, kProtocolVersion);
  msg += me.job_id;
  msg += connector_nonce;
  msg += acceptor_nonce;
  put_u32(&msg, static_cast<uint32_t>(connector_process));
  put_u32(&msg, static_cast<uint32_t>(acceptor_process));
  put_u32(&msg, static_cast<uint32_t>(channel));
#ifdef JAXRING_TCP_AUTH
  CryptoCall call;
  if (!call.allowed()) return "";  // as a failed HMAC below
  std::string mac(EVP_MAX_MD_SIZE, '\0');
  unsigned int len = 0;
  if (!HMAC(EVP_sha256(), me.secret.data(), static_cast<int>(me.secret.size()),
            reinterpret_cast<const unsigned char*>(msg.data()), msg.size(),
            reinterpret_cast<unsigned char*>(mac.data()), &len)) {
    return "";  // never equal to a received MAC (same_bytes checks the size)
  }
  mac.resize(len);
  return mac;
#else
  return "";
#endif
}

bool accept_handshake(int fd, const JobIdentity& me, Clock::time_point deadline,
                      int* process, int* channel, std::string* why) {
  if (handshakes_closed()) {
    *why = kClosedError;
    return false;
  }
  char hello[kHelloBytes];
  if (read_exact_by(fd, hello, 8, deadline, why) != ReadResult::kOk)
    return false;
  if (get_u32(hello) != kWireMagic) {
    *why = "not a jaxring peer";
    return false;
  }
  if (get_u32(hello + 4) != kProtocolVersion) {
    std::string ignored;
    send_bytes(fd, reply(me, kWrongVersion, "", ""), deadline, &ignored);
    *why = "protocol version " + std::to_string(get_u32(hello + 4));
    return false;
  }
  if (read_exact_by(fd, hello + 8, kHelloBytes - 8, deadline, why) !=
      ReadResult::kOk) {
    return false;
  }
  const int p = get_i32(hello + 8);
  const int c = get_i32(hello + 12);
  if (p < 0 || p >= me.processes || p == me.process || c < 0 ||
      c >= kMaxChannels) {
    std::string ignored;
    send_bytes(fd, reply(me, kUnknownProcess, "", ""), deadline, &ignored);
    *why = "claims process " + std::to_string(p) + ", channel " +
           std::to_string(c);
    return false;
  }
  const std::string connector_nonce(hello + 16, kNonceBytes);
  std::string nonce;
  if (!fresh_nonce(&nonce)) {
    *why = "no random bytes for a nonce";
    return false;
  }
  const std::string mac =
      handshake_mac(me, true, connector_nonce, nonce, p, me.process, c);
  if (!send_bytes(fd, reply(me, kHandshakeOk, nonce, mac), deadline, why))
    return false;
  std::string proof(kMacBytes, '\0');
  if (read_exact_by(fd, proof.data(), kMacBytes, deadline, why) !=
      ReadResult::kOk) {
    return false;
  }
  if (!same_bytes(proof, handshake_mac(me, false, connector_nonce, nonce, p,
                                       me.process, c))) {
    *why = "a wrong proof for process " + std::to_string(p);
    return false;
  }
  *process = p;
  *channel = c;
  return true;
}

bool connect_handshake(int fd, const JobIdentity& me, int peer, int channel,
                       Clock::time_point deadline, std::string* error) {
  if (handshakes_closed()) {
    *error = kClosedError;
    return false;
  }
  std::ostringstream who;
  who << "process " << peer;
  std::string nonce;
  if (!fresh_nonce(&nonce)) {
    *error = handshakes_closed() ? kClosedError
                                 : "no random bytes for a handshake nonce "
                                   "(OpenSSL RAND_bytes failed)";
    return false;
  }
  std::string hello;
  put_u32(&hello, kWireMagic);
  put_u32(&hello, kProtocolVersion);
  put_u32(&hello, static_cast<uint32_t>(me.process));
  put_u32(&hello, static_cast<uint32_t>(channel));
  hello += nonce;
  if (!send_bytes(fd, hello, deadline, error)) return false;
  char r[kReplyBytes];
  std::string why;
  const ReadResult head = read_exact_by(fd, r, 8, deadline, &why);
  if (head == ReadResult::kClosed) {
    *error = who.str() +
             " closed the connection during the handshake: it is "
             "not a jaxring process, or runs a jaxring build older than wire "
             "protocol version " +
             std::to_string(kProtocolVersion) +
             " (every process of a job must run the same build)";
    return false;
  }
  if (head != ReadResult::kOk) {
    *error = who.str() + " did not complete the handshake: " + why;
    return false;
  }
  if (get_u32(r) != kWireMagic) {
    *error = who.str() + "'s address answers, but not as a jaxring process";
    return false;
  }
  if (get_u32(r + 4) != kProtocolVersion) {
    std::ostringstream os;
    os << who.str() << " speaks jaxring wire protocol version "
       << get_u32(r + 4) << " and this process version " << kProtocolVersion
       << ": every process of a job must run the same jaxring build";
    *error = os.str();
    return false;
  }
  if (read_exact_by(fd, r + 8, kReplyBytes - 8, deadline, &why) !=
      ReadResult::kOk) {
    *error = who.str() + " did not complete the handshake: " + why;
    return false;
  }
  const int status = get_i32(r + 12);
  if (status == kUnknownProcess) {
    std::ostringstream os;
    os << who.str() << " does not count this process (" << me.process
       << ") among its job's processes: the processes disagree on the job";
    *error = os.str();
    return false;
  }
  const std::string acceptor_nonce(r + 16, kNonceBytes);
  const std::string mac(r + 16 + kNonceBytes, kMacBytes);
  if (status != kHandshakeOk || get_i32(r + 8) != peer ||
      !same_bytes(mac, handshake_mac(me, true, nonce, acceptor_nonce,
                                     me.process, peer, channel))) {
    *error = "the process listening at " + who.str() +
             "'s address did not prove that it is " + who.str() +
             " of this job (another job, or a different JAXRING_JOB_SECRET)";
    return false;
  }
  return send_bytes(fd,
                    handshake_mac(me, false, nonce, acceptor_nonce, me.process,
                                  peer, channel),
                    deadline, error);
}

}  // namespace jaxring
