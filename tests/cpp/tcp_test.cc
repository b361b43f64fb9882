// The TCP transport between two forked processes of one host (whose data
// goes through shared-memory rings): many allreduces at once, flat and
// tiered, in any order of the ranks; a frame that fails an operation on a
// process before it knows its peers' addresses; and hostile peers, from
// strangers that never get past the handshake to an authenticated process
// that sends frames its plan does not allow, after which the victim still
// reduces correctly. Forks: test suite "before threads".
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <doctest/doctest.h>

#include "cpu/net/frames.h"
#include "cpu/net/shm_link.h"
#include "cpu/net/tcp_transport.h"
#include "helpers.h"

namespace {

using jaxring_test::test_job;

// A data frame's header as it goes on the wire.
using WireHeader = jaxring::FrameHeader;

int connect_loopback(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (fd < 0 ||
      connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    if (fd >= 0) close(fd);
    return -1;
  }
  return fd;
}

// Whether the peer closed fd within timeout_ms (reads return 0 or fail;
// anything the peer sent first is skipped).
bool closed_by_peer(int fd, int timeout_ms) {
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  for (;;) {
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, 50) > 0) {
      char c[256];
      if (recv(fd, c, sizeof(c), 0) <= 0) return true;
    }
    if (std::chrono::steady_clock::now() > deadline) return false;
  }
}

bool write_all(int fd, const std::string& bytes) {
  return write(fd, bytes.data(), bytes.size()) ==
         static_cast<ssize_t>(bytes.size());
}

// A hello as the handshake's connector sends it (tcp_handshake.h).
std::string hello_bytes(uint32_t version, int process, int channel,
                        const std::string& nonce) {
  std::string out;
  for (uint32_t v :
       {jaxring::kWireMagic, version, static_cast<uint32_t>(process),
        static_cast<uint32_t>(channel)}) {
    for (int i = 0; i < 4; ++i)
      out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
  }
  return out + nonce;
}

// Sends a hello as process `from` on `channel`, reads the 64-byte reply
// and answers with the proof `as` would compute for a connection to process
// `to`; returns the connection.
int prove_as(int victim_port, const jaxring::JobIdentity& as, int channel,
             bool garble, int from = 1, int to = 0) {
  const int fd = connect_loopback(victim_port);
  CHECK(fd >= 0);
  const std::string nonce(jaxring::kNonceBytes, 'n');
  CHECK(write_all(
      fd, hello_bytes(jaxring::kProtocolVersion, from, channel, nonce)));
  char reply[64];
  size_t got = 0;
  while (got < sizeof(reply)) {
    const ssize_t r = read(fd, reply + got, sizeof(reply) - got);
    CHECK(r > 0);
    if (r <= 0) return fd;
    got += static_cast<size_t>(r);
  }
  std::string proof = jaxring::handshake_mac(
      as, false, nonce, std::string(reply + 16, jaxring::kNonceBytes), from, to,
      channel);
  if (garble) proof[0] ^= 1;
  // After the proof, the connector offers a shared-memory ring: none here.
  jaxring::ShmOffer no_offer{};
  no_offer.magic = jaxring::kShmOfferMagic;
  CHECK(write_all(fd,
                  proof + std::string(reinterpret_cast<const char*>(&no_offer),
                                      sizeof(no_offer))));
  return fd;
}

// Hostile input against process 0 of a 2-process job, played by process 1.
// Strangers never get past the handshake; a peer that did (process 1 on a
// channel of its own) still cannot make process 0 allocate or believe what
// its plan does not allow. Returns a connection to keep open until the job
// ends (closing an authenticated one means that process 1 left).
int attack(int victim_port) {
  const jaxring::JobIdentity job = test_job(1);
  // Bytes that are not jaxring at all.
  int fd = connect_loopback(victim_port);
  CHECK((fd >= 0 && write_all(fd, std::string(40, 'x'))));
  CHECK(closed_by_peer(fd, 5000));
  close(fd);
  // A hello of another protocol version: answered with this one, then closed.
  fd = connect_loopback(victim_port);
  CHECK((fd >= 0 && write_all(fd, hello_bytes(2, 1, 0, std::string(16, 'n')))));
  CHECK(closed_by_peer(fd, 5000));
  close(fd);
  // A hello for a process the job does not have.
  fd = connect_loopback(victim_port);
  CHECK((fd >= 0 && write_all(fd, hello_bytes(jaxring::kProtocolVersion, 5, 0,
                                              std::string(16, 'n')))));
  CHECK(closed_by_peer(fd, 5000));
  close(fd);
  // A wrong proof; the proof of the same secret for another job; a proof
  // made with another secret.
  jaxring::JobIdentity other_job = job, other_secret = job;
  other_job.job_id = "another job, 16b";
  other_secret.secret = "a guess at the secret, 32 bytes.";
  for (const auto& [as, garble] :
       {std::pair{job, true}, std::pair{other_job, false},
        std::pair{other_secret, false}}) {
    fd = prove_as(victim_port, as, 5, garble);
    CHECK(closed_by_peer(fd, 5000));
    close(fd);
  }
  // Process 1 itself, once more on a channel it already has open: refused.
  fd = connect_loopback(victim_port);
  CHECK(fd >= 0);
  std::string error;
  CHECK(jaxring::connect_handshake(
      fd, job, 0, 0, std::chrono::steady_clock::now() + std::chrono::seconds(5),
      &error));
  CHECK(closed_by_peer(fd, 5000));
  close(fd);

  // Process 1, authenticated on a channel of its own, then misbehaving.
  WireHeader h{};
  h.magic = jaxring::kWireMagic;
  h.kind = jaxring::kData;
  h.run_id = 99;
  h.op_id = 12345;
  h.world_size = 2;
  h.num_rings = 1;
  h.count = int64_t{1} << 37;
  h.chunk_bytes = 1 << 20;
  h.payload_bytes = int64_t{1} << 40;
  // An unknown element type: nothing this build sends, so the connection
  // is closed before any state is made for the operation.
  fd = prove_as(victim_port, job, 6, false);
  h.elem_type = 99;
  CHECK(write(fd, &h, sizeof(h)) == sizeof(h));
  CHECK(closed_by_peer(fd, 5000));
  close(fd);
  // A plausible header whose payload (a TiB) does not fit the plan: refused
  // and drained a slice at a time, never allocated from the frame's word
  // (it used to end the victim with std::bad_alloc).
  fd = prove_as(victim_port, job, 7, false);
  h.elem_type = 2;
  CHECK(write(fd, &h, sizeof(h)) == sizeof(h));
  std::vector<char> some(1 << 16, 7);
  CHECK(write(fd, some.data(), some.size()) ==
        static_cast<ssize_t>(some.size()));
  return fd;
}

// Runs rank's part of a TCP allreduce and waits for it; its error, if any.
std::optional<std::string> tcp_allreduce_and_wait(const jaxring::OpKey& key,
                                                  const jaxring::OpDesc& desc,
                                                  int rank,
                                                  const std::vector<int>& procs,
                                                  const void* in, void* out,
                                                  double timeout_s) {
  std::mutex mu;
  std::condition_variable cv;
  bool finished = false;
  std::optional<std::string> err;
  jaxring::tcp_allreduce(key, desc, rank, /*device=*/rank, procs, in, out,
                         timeout_s, [&](const std::optional<std::string>& e) {
                           std::lock_guard<std::mutex> lock(mu);
                           err = e;
                           finished = true;
                           cv.notify_all();
                         });
  std::unique_lock<std::mutex> lock(mu);
  cv.wait(lock, [&] { return finished; });
  return err;
}

// The operation of the early bad frame (below): process 1 never runs it.
constexpr int64_t kEarlyBadOp = 999;

// Played by process 0 before process 1's set_peers: a frame on a channel of
// its own, for an operation process 1 never runs, that does not fit its
// plan. Process 1 fails the operation and owes process 0 an abort, though
// it does not know yet where process 0 listens: the abort waits for its
// set_peers. Returns the connection, to keep open until the job ends.
int early_bad_frame(int peer_port) {
  const int fd =
      prove_as(peer_port, test_job(0), 60, false, /*from=*/0, /*to=*/1);
  WireHeader h{};
  h.magic = jaxring::kWireMagic;
  h.kind = jaxring::kData;
  h.run_id = 7;
  h.op_id = kEarlyBadOp;
  h.dst_rank = 1;
  h.src_rank = 0;
  h.elem_type = static_cast<int32_t>(jaxring::ElemType::kS32);
  h.world_size = 2;
  h.num_rings = 1;
  h.count = 1024;
  h.chunk_bytes = 4096;
  h.unit = 999;  // the plan has no such unit
  h.payload_bytes = 64;
  CHECK(write(fd, &h, sizeof(h)) == sizeof(h));
  const std::vector<char> payload(64, 1);
  CHECK(write(fd, payload.data(), payload.size()) ==
        static_cast<ssize_t>(payload.size()));
  return fd;
}

// One process of the TCP test: process `me` of 2 runs the ranks r with
// process_of_rank[r] == me, all operations at once from their own threads.
int tcp_process(int me, int port_out_fd, int ports_in_fd) {
  std::string error;
  const int port =
      jaxring::tcp_listen("127.0.0.1", test_job(me), /*use_shm=*/true, &error);
  if (port < 0) {
    std::fprintf(stderr, "tcp_listen: %s\n", error.c_str());
    return 1;
  }
  if (write(port_out_fd, &port, sizeof(port)) != sizeof(port)) return 1;
  int ports[2];
  if (read(ports_in_fd, ports, sizeof(ports)) != sizeof(ports)) return 1;
  // Process 1 learns the addresses late: process 0 connects, and offers its
  // rings, before process 1's set_peers, which must not matter (the
  // shared-memory choice was fixed by tcp_listen). Process 0 also sends it
  // a frame that fails an operation there meanwhile.
  const int early = me == 0 ? early_bad_frame(ports[1]) : -1;
  if (me == 1) std::this_thread::sleep_for(std::chrono::milliseconds(300));
  // The two processes share this host: their data goes through
  // shared-memory rings (the hostile peer's connections stay on TCP).
  CHECK(jaxring::tcp_set_peers({"127.0.0.1:" + std::to_string(ports[0]),
                                "127.0.0.1:" + std::to_string(ports[1])},
                               {1 - me}, &error));
  struct Case {
    std::vector<int> procs;
    int rings;
    int64_t count, chunk;
    std::vector<int> topology;  // empty: the flat ring
  };
  const std::vector<Case> cases = {
      {{0, 1}, 1, 1, 4, {}},
      {{0, 1}, 2, 1000, 256, {}},
      {{1, 0}, 3, 100003, 4096, {}},
      {{0, 0, 1, 1}, 2, 20000, 512, {}},
      {{0, 1, 0, 1}, 1, 777, 64, {}},
      {{0, 1, 1}, 2, 0, 64, {}},
      // Tiered plans: in-process tiers whose units go through staging, and
      // phases that cross the processes.
      {{0, 0, 1, 1}, 2, 20000, 512, {2, 2}},
      {{0, 0, 0, 0, 1, 1, 1, 1}, 3, 100003, 4096, {2, 2, 2}},
      {{0, 1, 0, 1}, 1, 777, 64, {2, 2}},
      {{0, 0, 0, 1, 1, 1}, 2, 5, 64, {3, 2}},
  };
  std::mutex mu;
  int ok = 0, expected = 0;
  auto run_cases = [&](const std::vector<Case>& cases, int64_t first_op_id) {
    std::vector<std::thread> threads;
    for (size_t k = 0; k < cases.size(); ++k) {
      const Case c = cases[k];
      const int p = static_cast<int>(c.procs.size());
      for (int r = 0; r < p; ++r) {
        if (c.procs[r] != me) continue;
        ++expected;
        threads.emplace_back([&, c, k, r, p] {
          std::vector<int32_t> in(c.count), out(c.count, -1);
          for (int64_t i = 0; i < c.count; ++i) in[i] = (r + 1) * 3 + i % 11;
          jaxring::OpDesc desc;
          desc.type = jaxring::ElemType::kS32;
          desc.count = c.count;
          desc.world_size = p;
          desc.num_rings = c.rings;
          desc.chunk_bytes = c.chunk;
          desc.topology = c.topology;
          const std::optional<std::string> err = tcp_allreduce_and_wait(
              {7, first_op_id + static_cast<int64_t>(k), 0}, desc, r, c.procs,
              in.data(), out.data(), 30.0);
          bool good = !err;
          for (int64_t i = 0; good && i < c.count; ++i) {
            int32_t want = 0;
            for (int q = 0; q < p; ++q) want += (q + 1) * 3 + i % 11;
            good = out[i] == want;
          }
          if (err) std::fprintf(stderr, "tcp case %zu: %s\n", k, err->c_str());
          std::lock_guard<std::mutex> g(mu);
          ok += good;
        });
      }
    }
    for (auto& t : threads) t.join();
  };
  run_cases(cases, 0);
  if (me == 0) {
    // Process 1's abort for the early bad frame arrived once it knew the
    // addresses: this process's rank of that operation fails at once with
    // process 1's reason, instead of waiting out its timeout for a process
    // that will never run it.
    const std::vector<int32_t> in(1024, 1);
    std::vector<int32_t> out(1024);
    jaxring::OpDesc desc;
    desc.type = jaxring::ElemType::kS32;
    desc.count = 1024;
    desc.world_size = 2;
    desc.num_rings = 1;
    desc.chunk_bytes = 4096;
    const auto started = std::chrono::steady_clock::now();
    const std::optional<std::string> err = tcp_allreduce_and_wait(
        {7, kEarlyBadOp, 0}, desc, 0, {0, 1}, in.data(), out.data(), 20.0);
    CHECK((err && err->find("does not fit the plan") != std::string::npos &&
           err->find("[reported by process 1]") != std::string::npos));
    CHECK(std::chrono::steady_clock::now() - started <
          std::chrono::seconds(10));
  }
  // Process 1 plays a stranger against process 0; one more allreduce then
  // shows that process 0 survived and still reduces correctly.
  const int kept = me == 1 ? attack(ports[0]) : -1;
  run_cases({{{0, 1}, 2, 1000, 256, {}}, {{1, 0, 1, 0}, 1, 777, 64, {2, 2}}},
            100);
  // Every operation is dropped once its ranks completed, except two failed
  // ones on each process, which stay until they expire: the one the
  // misbehaving frame made on process 0 and its echo on process 1 (process 0
  // tells the frame's sender), and the early bad frame's on both. (Only at
  // the end: a process waiting for this while its peer already started the
  // next operation would wait for ever.)
  while (jaxring::tcp_pending_ops() > 2) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  if (me == 0) {
    // Six strangers and one second connection were refused; the
    // authenticated misbehaving connections are not refusals.
    const jaxring::TcpTransportInfo info = jaxring::tcp_transport_info();
    CHECK(info.refused_connections == 7);
    CHECK(info.last_refusal.find("second connection") != std::string::npos);
  }
  {
    // The job's own connections carried their data through shared memory.
    const jaxring::TcpTransportInfo info = jaxring::tcp_transport_info();
    CHECK((info.use_shm && !info.shm_outbound.empty() &&
           !info.shm_inbound.empty()));
    CHECK(info.shm_unavailable.empty());
    // Frames went out from the workers that sent them.
    CHECK(info.data_frames_by_device_thread > 0);
    if (me == 1) {
      // Every connection from process 0 maps its ring, the early ones too.
      std::set<std::pair<int, int>> in(info.inbound.begin(),
                                       info.inbound.end());
      in.erase({0, 60});  // the early bad frame's, which offered no ring
      std::set<std::pair<int, int>> shm(info.shm_inbound.begin(),
                                        info.shm_inbound.end());
      CHECK(in == shm);
    }
  }
  if (kept >= 0) {
    // Leave after process 0 is done, so that the kept connection's close
    // cannot look like a lost peer while its last operation runs.
    std::this_thread::sleep_for(std::chrono::seconds(1));
    close(kept);
  }
  if (early >= 0) close(early);
  // A failed assertion also fails this process (fork_child).
  return ok == expected ? 0 : 1;
}

}  // namespace

TEST_SUITE(jaxring_test::kBeforeThreads) {
  // Forks the two processes of the TCP test and relays their ports.
  TEST_CASE("TCP transport: two forked processes, and hostile peers") {
    int to_parent[2][2], to_child[2][2];
    pid_t pids[2];
    for (int me = 0; me < 2; ++me) {
      CHECK((pipe(to_parent[me]) == 0 && pipe(to_child[me]) == 0));
      pids[me] = jaxring_test::fork_child([&, me] {
        return tcp_process(me, to_parent[me][1], to_child[me][0]);
      });
    }
    int ports[2];
    for (int me = 0; me < 2; ++me) {
      CHECK(read(to_parent[me][0], &ports[me], sizeof(int)) == sizeof(int));
    }
    for (int me = 0; me < 2; ++me) {
      CHECK(write(to_child[me][1], ports, sizeof(ports)) == sizeof(ports));
    }
    for (int me = 0; me < 2; ++me) {
      int status = 0;
      CHECK(waitpid(pids[me], &status, 0) == pids[me]);
      CHECK_MESSAGE((WIFEXITED(status) && WEXITSTATUS(status) == 0), "process ",
                    me, ": wait status ", status);
    }
  }
}
