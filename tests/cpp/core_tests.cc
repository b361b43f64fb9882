// Stand-alone tests of the ring plan, the reductions and both transports,
// without Python or XLA, so they can run under AddressSanitizer,
// UndefinedBehaviorSanitizer and ThreadSanitizer:
//
//   opts="-DJAXRING_BUILD_PYTHON=OFF -DJAXRING_BUILD_CORE_TESTS=ON"
//   cmake -S . -B build-san $opts -DJAXRING_SANITIZE=address,undefined
//   cmake --build build-san && ./build-san/jaxring_core_tests
//
// (and the same with -DJAXRING_SANITIZE=thread). Each device is a thread,
// as XLA's virtual CPU devices are. The TCP transport runs in two forked
// processes first, while this process has no threads yet.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <future>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <numeric>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "cpu/buffer_pool.h"
#include "cpu/gang_start.h"
#include "cpu/direct/host_direct.h"
#include "cpu/direct/host_segment.h"
#include "cpu/plan/inprocess_plan_host.h"
#include "cpu/inprocess/link_pacing.h"
#include "cpu/inprocess/inprocess_transport.h"
#include "cpu/dispatch.h"
#include "cpu/net/shm_link.h"
#include "cpu/shm_segment.h"
#include "cpu/net/tcp_transport.h"
#include "cpu/net/frames.h"
#include "plan.h"
#include "reduce.h"
#include "stream_schedule.h"
#include "tiered_plan.h"

namespace {

int failures = 0;

#define CHECK(cond)                                                         \
  do {                                                                      \
    if (!(cond)) {                                                          \
      std::fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, \
                   #cond);                                                  \
      ++failures;                                                           \
    }                                                                       \
  } while (0)

// Replays the plan on per-rank contribution counts.
void check_plan(int p, int rings, int64_t count, int64_t chunk) {
  jaxring::RingPlan plan(p, rings, count, 4, chunk);
  std::vector<std::vector<int>> have(p * count, std::vector<int>(p, 0));
  auto at = [&](int rank, int64_t i) -> std::vector<int>& {
    return have[rank * count + i];
  };
  for (int r = 0; r < p; ++r)
    for (int64_t i = 0; i < count; ++i) at(r, i)[r] = 1;
  for (const auto& t : plan.transfers()) {
    for (int64_t i = t.span.offset; i < t.span.offset + t.span.count; ++i) {
      std::vector<int> v = at(t.src_rank, i);
      if (t.reduce) v[t.dst_rank] += 1;
      at(t.dst_rank, i) = v;
    }
  }
  for (int r = 0; r < p; ++r)
    for (int64_t i = 0; i < count; ++i)
      for (int s = 0; s < p; ++s) CHECK(at(r, i)[s] == 1);
}

struct Done {
  std::mutex mu;
  std::condition_variable cv;
  int remaining;
  std::vector<std::string> errors;
};

// Starts one allreduce with a thread per rank, in `order`, and waits until
// every rank's completion has run; returns the errors they reported.
std::vector<std::string> run_ranks(const std::vector<int>& order,
                                   const jaxring::OpKey& key,
                                   const jaxring::OpDesc& desc,
                                   const std::vector<const void*>& in,
                                   const std::vector<void*>& out,
                                   double timeout_s) {
  Done done;
  done.remaining = static_cast<int>(order.size());
  std::vector<std::thread> threads;
  for (int r : order) {
    threads.emplace_back([&, r] {
      jaxring::cpu_allreduce(key, desc, r, /*device=*/r,
                             /*process_of_rank=*/{}, in[r], out[r], timeout_s,
                             [&](const std::optional<std::string>& err) {
                               std::lock_guard<std::mutex> lock(done.mu);
                               if (err) done.errors.push_back(*err);
                               if (--done.remaining == 0) done.cv.notify_all();
                             });
    });
  }
  for (auto& t : threads) t.join();
  std::unique_lock<std::mutex> lock(done.mu);
  done.cv.wait(lock, [&] { return done.remaining == 0; });
  return done.errors;
}

// Runs one allreduce of `count` int32 values among p "devices", each
// started from its own thread in a shuffled order, and checks the sums.
// in_place: every rank's output is its input buffer (as when XLA aliases
// them).
void run_allreduce(int p, int rings, int64_t count, int64_t chunk_bytes,
                   int64_t op_id, unsigned seed,
                   jaxring::Algorithm algorithm = jaxring::Algorithm::kRing,
                   bool in_place = false, double link_bytes_per_s = 0) {
  std::vector<std::vector<int32_t>> in(p, std::vector<int32_t>(count));
  std::vector<std::vector<int32_t>> out(p, std::vector<int32_t>(count, -1));
  std::vector<int64_t> expect(count, 0);
  for (int r = 0; r < p; ++r)
    for (int64_t i = 0; i < count; ++i) {
      in[r][i] = static_cast<int32_t>((r + 1) * 7 + i % 13);
      expect[i] += in[r][i];
    }
  jaxring::OpDesc desc;
  desc.type = jaxring::ElemType::kS32;
  desc.op = jaxring::ReduceOp::kSum;
  desc.count = count;
  desc.world_size = p;
  desc.num_rings = rings;
  desc.chunk_bytes = chunk_bytes;
  desc.algorithm = algorithm;
  if (link_bytes_per_s > 0) desc.link = {{p, link_bytes_per_s, 2e-6}};
  std::vector<int> order(p);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), std::mt19937(seed));
  std::vector<const void*> ins;
  std::vector<void*> outs;
  for (int r = 0; r < p; ++r) {
    ins.push_back(in[r].data());
    outs.push_back(in_place ? in[r].data() : out[r].data());
  }
  CHECK(run_ranks(order, jaxring::OpKey{1, op_id, 0}, desc, ins, outs, 30.0)
            .empty());
  for (int r = 0; r < p; ++r)
    for (int64_t i = 0; i < count; ++i)
      CHECK((in_place ? in : out)[r][i] == static_cast<int32_t>(expect[i]));
}

// A data frame's header as it goes on the wire.
using WireHeader = jaxring::FrameHeader;

// The job of the TCP test, as process `me` holds it.
jaxring::JobIdentity test_job(int me) {
  jaxring::JobIdentity id;
  id.process = me;
  id.processes = 2;
  id.secret = "core-test secret, 32 bytes long.";
  id.job_id = "core-test job 01";
  return id;
}

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
  CHECK(fd >= 0 && write_all(fd, std::string(40, 'x')));
  CHECK(closed_by_peer(fd, 5000));
  close(fd);
  // A hello of another protocol version: answered with this one, then closed.
  fd = connect_loopback(victim_port);
  CHECK(fd >= 0 && write_all(fd, hello_bytes(2, 1, 0, std::string(16, 'n'))));
  CHECK(closed_by_peer(fd, 5000));
  close(fd);
  // A hello for a process the job does not have.
  fd = connect_loopback(victim_port);
  CHECK(fd >= 0 && write_all(fd, hello_bytes(jaxring::kProtocolVersion, 5, 0,
                                             std::string(16, 'n'))));
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
    CHECK(err && err->find("does not fit the plan") != std::string::npos &&
          err->find("[reported by process 1]") != std::string::npos);
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
    CHECK(info.use_shm && !info.shm_outbound.empty() &&
          !info.shm_inbound.empty());
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
  return ok == expected && failures == 0 ? 0 : 1;
}

// Forks the two processes of the TCP test and relays their ports.
// The dispatch table (cpu/dispatch.cc) against the rules it encodes, for
// every algorithm, place, link and tiering: refused combinations name
// what is wrong, and each other one has exactly its executor.
void run_dispatch_tests() {
  using jaxring::Algorithm;
  using jaxring::Executor;
  for (Algorithm a : {Algorithm::kRing, Algorithm::kDirect,
                      Algorithm::kExchange, Algorithm::kNccl})
    for (bool one_process : {true, false})
      for (bool emulated : {true, false})
        for (bool tiered : {true, false}) {
          jaxring::OpDesc desc;
          desc.algorithm = a;
          desc.world_size = 4;
          if (emulated) desc.link = {jaxring::EmulatedTier{4, 1e9, 1e-6}};
          if (tiered) desc.topology = {2, 2};
          const jaxring::Route r = jaxring::route(desc, one_process);
          std::optional<Executor> want;
          std::string refused;
          if (a == Algorithm::kNccl) {
            refused = "no CPU executor";
          } else if (a == Algorithm::kDirect && emulated) {
            refused = "no transfers for link emulation";
          } else if (a == Algorithm::kDirect && tiered) {
            refused = "direct has no tiers";
          } else if (a == Algorithm::kExchange && tiered) {
            refused = "picks its own tiers";
          } else if (!one_process && emulated) {
            refused = "in-process transport only";
          } else if (a == Algorithm::kDirect) {
            want = one_process ? Executor::kInProcessDirect
                               : Executor::kHostDirect;
          } else if (!one_process) {
            want = Executor::kTcpPlan;
          } else if (emulated) {
            want = Executor::kInProcessEmulation;
          } else if (tiered || a == Algorithm::kExchange) {
            want = Executor::kInProcessPlan;
          } else {
            want = Executor::kInProcessRing;
          }
          CHECK(r.executor == want);
          CHECK(want || r.refusal.find(refused) != std::string::npos);
          CHECK(!want || r.refusal.empty());
        }
}

void run_tcp_test() {
  int to_parent[2][2], to_child[2][2];
  pid_t pids[2];
  for (int me = 0; me < 2; ++me) {
    CHECK(pipe(to_parent[me]) == 0 && pipe(to_child[me]) == 0);
    pids[me] = fork();
    if (pids[me] == 0) {
      std::fflush(stdout);
      _exit(tcp_process(me, to_parent[me][1], to_child[me][0]));
    }
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
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  }
}

// One rank of a direct allreduce across processes over the host segment:
// waits for its completion (at most 60 s) and returns its error, or "".
std::string host_direct_sum(int rank, int64_t op_id,
                            const std::vector<float>& in,
                            std::vector<float>* out, double timeout_s,
                            const std::vector<int>& process_of_rank = {0, 1}) {
  jaxring::OpDesc d;
  d.type = jaxring::ElemType::kF32;
  d.count = static_cast<int64_t>(in.size());
  d.world_size = static_cast<int>(process_of_rank.size());
  d.algorithm = jaxring::Algorithm::kDirect;
  d.slot_id = op_id;
  auto done = std::make_shared<std::promise<std::string>>();
  std::future<std::string> result = done->get_future();
  jaxring::host_direct_allreduce(
      jaxring::OpKey{1, op_id, 0}, d, rank, process_of_rank, in.data(),
      out->data(), timeout_s, [done](const std::optional<std::string>& e) {
        done->set_value(e ? *e : "");
      });
  if (result.wait_for(std::chrono::seconds(60)) != std::future_status::ready) {
    return "no completion within 60 s";
  }
  return result.get();
}

// Process `me` of two, in the host segment `shared` (process 0's, inherited
// through fork; process 1 maps it by name, as a peer does). Returns its
// failures.
int host_direct_process(int me, std::unique_ptr<jaxring::HostSegment> shared,
                        const std::string& job) {
  std::string error;
  std::unique_ptr<jaxring::HostSegment> seg =
      me == 0 ? std::move(shared)
              : jaxring::HostSegment::open(shared->name(), job, 1, &error);
  if (me == 1)
    (void)shared.release();  // process 0's object: not this one's to unmap
  CHECK(seg != nullptr);
  if (!seg) return failures;
  while (seg->mapped() < 2)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  if (me == 0) seg->unlink();
  seg->watch_peers(me);
  // The header, to rewrite it as a broken peer would (its sizes sit at
  // bytes 20 and 24, before the entries at 8 KiB).
  char* header = reinterpret_cast<char*>(&seg->entry(0)) - 8192;
  jaxring::set_host_segment(std::move(seg), me, "");
  auto pattern = [](int64_t i) { return static_cast<float>(i % 7 + 1); };
  auto check_sum = [&](int64_t op_id, int64_t count) {
    std::vector<float> in(count), out(count, -1.0f);
    for (int64_t i = 0; i < count; ++i) in[i] = (me + 1) * pattern(i);
    const std::string e = host_direct_sum(me, op_id, in, &out, 30.0);
    CHECK(e.empty());
    for (int64_t i = 0; i < count; ++i) {
      if (out[i] != 3 * pattern(i)) {
        CHECK(out[i] == 3 * pattern(i));
        break;
      }
    }
  };
  // Empty, short, and more than one 1 MiB chunk.
  for (int64_t count : {0, 1, 1000, 300001}) check_sum(10 + count % 97, count);
  // 12 operations in flight at once over 8 entries, started in opposite
  // orders: those that share an entry take turns, none waits for ever.
  {
    std::vector<std::thread> ops;
    for (int k = 0; k < 12; ++k) {
      const int64_t op = me == 0 ? 100 + k : 111 - k;
      ops.emplace_back([&, op] { check_sum(op, 5000 + op); });
    }
    for (auto& t : ops) t.join();
  }
  // Two ranks in each process, each served by a worker thread of its own,
  // several operations at once: every rank gets the sum of all four.
  {
    std::vector<std::thread> ops;
    for (int local = 0; local < 2; ++local) {
      for (int k = 0; k < 3; ++k) {
        ops.emplace_back([&, local, k] {
          const int rank = 2 * me + local;
          const int64_t count = 100000 + 1000 * k;
          std::vector<float> in(count), out(count, -1.0f);
          for (int64_t i = 0; i < count; ++i) in[i] = (rank + 1) * pattern(i);
          CHECK(host_direct_sum(rank, 200 + k, in, &out, 30.0, {0, 0, 1, 1})
                    .empty());
          for (int64_t i = 0; i < count; ++i) {
            if (out[i] != 10 * pattern(i)) {
              CHECK(out[i] == 10 * pattern(i));
              break;
            }
          }
        });
      }
    }
    for (auto& t : ops) t.join();
  }
  // One key many times in a row, as an allreduce in a loop's body runs in
  // one run: a rank done with one time starts the next while its peer may
  // still copy the last one's result out. Each time sums its own inputs.
  for (int64_t count : {1000, 300001, 0}) {
    for (int k = 0; k < 40; ++k) {
      std::vector<float> in(count), out(count, -1.0f);
      for (int64_t i = 0; i < count; ++i)
        in[i] = (me + 1) * (k + 1) * pattern(i);
      CHECK(host_direct_sum(me, 600 + count % 7, in, &out, 30.0).empty());
      for (int64_t i = 0; i < count; ++i) {
        if (out[i] != 3 * (k + 1) * pattern(i)) {
          CHECK(out[i] == 3 * (k + 1) * pattern(i));
          break;
        }
      }
    }
  }
  // Ranks that disagree on the count fail, both, saying so.
  {
    std::vector<float> in(me == 0 ? 100 : 200, 1.0f), out(in.size());
    const std::string e = host_direct_sum(me, 300, in, &out, 30.0);
    CHECK(e.find("kind=mismatch") != std::string::npos);
    CHECK(e.find("100 x float32") != std::string::npos &&
          e.find("200 x float32") != std::string::npos);
  }
  // A peer that rewrites the segment's sizes changes nothing here.
  if (me == 1) {
    reinterpret_cast<std::atomic<int32_t>*>(header + 20)->store(1 << 20);
    reinterpret_cast<std::atomic<int32_t>*>(header + 24)->store(1 << 20);
  }
  check_sum(400, 300001);
  // A peer that exits is named, long before the timeout.
  if (me == 1) return failures;
  std::vector<float> in(1000, 1.0f), out(1000);
  const auto start = std::chrono::steady_clock::now();
  const std::string e = host_direct_sum(me, 500, in, &out, 20.0);
  CHECK(e.find("kind=peer_lost peer=1") != std::string::npos);
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(5));
  CHECK(jaxring::host_direct_pending() == 0);
  return failures;
}

// Two forked processes of a direct allreduce over one host segment. Like
// run_tcp_test, it runs while this process has no threads yet.
void run_host_direct_test() {
  const std::string job = "core-tests-host-direct";
  std::string error;
  auto seg = jaxring::HostSegment::create(
      job, 0, 2, 4, &error);  // 2 processes, up to 4 ranks
  CHECK(seg != nullptr);
  if (!seg) return;
  pid_t pids[2];
  for (int me = 0; me < 2; ++me) {
    pids[me] = fork();
    if (pids[me] == 0) {
      std::fflush(stdout);
      _exit(host_direct_process(me, std::move(seg), job));
    }
  }
  for (int me = 0; me < 2; ++me) {
    int status = 0;
    CHECK(waitpid(pids[me], &status, 0) == pids[me]);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  }
}

// A process of another build opening the host segment: a segment whose
// first word names another layout version is refused, naming both.
void run_host_layout_test() {
  const std::string job = "core-tests-host-layout";
  std::string error;
  auto seg = jaxring::HostSegment::create(job, 0, 2, 2, &error);
  CHECK(seg != nullptr);
  if (!seg) return;
  CHECK(jaxring::HostSegment::open(seg->name(), job, 1, &error) != nullptr);
  const int fd = ::open(("/dev/shm" + seg->name()).c_str(), O_RDWR);
  CHECK(fd >= 0);
  uint64_t magic = 0;
  CHECK(::pread(fd, &magic, sizeof magic, 0) == sizeof magic);
  const uint64_t first_layout =
      (magic & ~uint64_t{0xffff}) | 0x5347;  // "...SG"
  CHECK(::pwrite(fd, &first_layout, sizeof first_layout, 0) ==
        sizeof first_layout);
  ::close(fd);
  error.clear();
  CHECK(jaxring::HostSegment::open(seg->name(), job, 1, &error) == nullptr);
  CHECK(error.find(
            "layout version 1 and this jaxring build lays it out as version") !=
        std::string::npos);
  CHECK(error.find("same jaxring build") != std::string::npos);
}

}  // namespace

// One float allreduce among p ranks started from their own threads; returns
// every rank's output and the wall time, and fills *errors.
std::vector<std::vector<float>> float_allreduce(
    int p, int64_t count, const jaxring::OpDesc& base, int64_t op_id,
    double timeout_s, std::vector<std::string>* errors, double* wall_s) {
  std::vector<std::vector<float>> in(p, std::vector<float>(count));
  std::vector<std::vector<float>> out(p, std::vector<float>(count, -1));
  std::mt19937 gen(static_cast<unsigned>(op_id));
  std::normal_distribution<float> normal(0.f, 1e3f);
  for (auto& v : in)
    for (auto& x : v) x = normal(gen);
  jaxring::OpDesc desc = base;
  desc.type = jaxring::ElemType::kF32;
  desc.count = count;
  desc.world_size = p;
  std::vector<int> order;
  std::vector<const void*> ins;
  std::vector<void*> outs;
  for (int r = 0; r < p; ++r) {
    order.push_back(p - 1 - r);
    ins.push_back(in[r].data());
    outs.push_back(out[r].data());
  }
  const auto t0 = std::chrono::steady_clock::now();
  *errors =
      run_ranks(order, jaxring::OpKey{3, op_id, 0}, desc, ins, outs, timeout_s);
  *wall_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0)
                .count();
  return out;
}

// Link emulation moves the data on one thread in the plan's order: the
// floats must be the threaded ring's, bit for bit; the operation takes at
// least the link's time; and a link too slow for the timeout is an error
// that names the ranks, with no buffer touched after it.
void run_emulation_tests() {
  const int p = 5;
  const int64_t count = 40000;  // 160 KB per rank
  for (int rings : {1, 3})
    for (int64_t chunk : {int64_t{4096}, int64_t{1} << 20}) {
      jaxring::OpDesc desc;
      desc.num_rings = rings;
      desc.chunk_bytes = chunk;
      std::vector<std::string> errors;
      double wall = 0;
      const auto threaded =
          float_allreduce(p, count, desc, 10 + rings, 30, &errors, &wall);
      CHECK(errors.empty());
      desc.link = {{p, 200e6, 50e-6}};
      const auto emulated =
          float_allreduce(p, count, desc, 10 + rings, 30, &errors, &wall);
      CHECK(errors.empty());
      for (int r = 0; r < p; ++r) {
        CHECK(std::memcmp(threaded[r].data(), emulated[r].data(), count * 4) ==
              0);
        CHECK(std::memcmp(emulated[0].data(), emulated[r].data(), count * 4) ==
              0);
      }
      // Each rank sends 2(p-1)/p of its buffer over its own link.
      const double link_s =
          2.0 * (p - 1) / p * count * 4 / desc.link[0].bytes_per_s;
      CHECK(wall >= 0.95 * link_s);
    }
  {
    // 20 MiB per rank: the data is cut into shares that several workers
    // take at once (see kMinShareBytes); still the ring's bits.
    jaxring::OpDesc desc;
    desc.num_rings = 2;
    desc.chunk_bytes = 256 << 10;
    std::vector<std::string> errors;
    double wall = 0;
    const int64_t big = 5 << 20;
    const auto threaded = float_allreduce(3, big, desc, 30, 60, &errors, &wall);
    CHECK(errors.empty());
    desc.link = {{3, 1e11, 0}};
    const auto emulated = float_allreduce(3, big, desc, 30, 60, &errors, &wall);
    CHECK(errors.empty());
    for (int r = 0; r < 3; ++r) {
      CHECK(std::memcmp(threaded[r].data(), emulated[r].data(), big * 4) == 0);
    }
  }
  {
    // An allreduce started while another's transfers are booked on the same
    // links goes in their gaps. The first here waits 250 ms for each of its
    // 4 steps and sends almost nothing: its links idle. The second (1 ms
    // per step) must not wait for the first's last step, as it would if
    // bookings were only appended.
    jaxring::OpDesc slow, quick;
    slow.link = {{3, 1e9, 0.25}};
    quick.link = {{3, 1e9, 1e-3}};
    std::vector<std::string> slow_errors, quick_errors;
    double slow_wall = 0, quick_wall = 0;
    std::thread first([&] {
      float_allreduce(3, 30, slow, 40, 60, &slow_errors, &slow_wall);
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(150));
    float_allreduce(3, 30, quick, 41, 60, &quick_errors, &quick_wall);
    first.join();
    CHECK(slow_errors.empty() && quick_errors.empty());
    CHECK(slow_wall > 0.95);
    CHECK(quick_wall < 0.35);
  }
  {
    jaxring::OpDesc desc;
    desc.link = {{3, 1e6, 0}};  // 0.5 s of link for 0.2 s of timeout
    std::vector<std::string> errors;
    double wall = 0;
    float_allreduce(3, 100000, desc, 20, 0.2, &errors, &wall);
    CHECK(errors.size() == 3);
    for (const auto& e : errors)
      CHECK(e.find("did not finish") != std::string::npos);
  }
}

// Gang start: every rank waits for the last; a rank of another operation
// passes while one gathers; a missing rank costs at most the wait.
// Tiered plans among the threads of one process run on the plan executor:
// exact int32 sums for every rank, started in shuffled orders, into separate
// outputs and in place, plain and on an emulated two-tier cluster.
void run_tiered_tests() {
  int64_t op_id = 50000;
  // Tiered plans of 8 ranks, then the exchange plan (empty dims) of p ranks.
  struct Case {
    std::vector<int> dims;
    int p;
  };
  const std::vector<Case> cases = {{{2, 4}, 8}, {{4, 2}, 8}, {{2, 2, 2}, 8},
                                   {{}, 2},     {{}, 3},     {{}, 6},
                                   {{}, 8},     {{}, 12}};
  for (const auto& [dims, p] : cases)
    for (int rings : {1, 3})
      for (int64_t count : {0, 1, 7, 1000, 100003})
        for (int variant = 0; variant < 3; ++variant) {
          const bool exchange = dims.empty();
          const bool in_place = variant == 1, emulated = variant == 2;
          std::vector<std::vector<int32_t>> in(p, std::vector<int32_t>(count));
          std::vector<std::vector<int32_t>> out(
              p, std::vector<int32_t>(count, -1));
          std::vector<int32_t> expect(count, 0);
          for (int r = 0; r < p; ++r)
            for (int64_t i = 0; i < count; ++i) {
              in[r][i] = static_cast<int32_t>((r + 3) * (i % 11) - r);
              expect[i] += in[r][i];
            }
          jaxring::OpDesc desc;
          desc.type = jaxring::ElemType::kS32;
          desc.count = count;
          desc.world_size = p;
          desc.num_rings = rings;
          desc.chunk_bytes = 1024;
          desc.topology = dims;
          if (exchange) desc.algorithm = jaxring::Algorithm::kExchange;
          if (emulated && exchange) desc.link = {{p, 2e9, 5e-6}};
          if (emulated && !exchange) {
            desc.link = {{dims[0], 20e9, 1e-6}, {p / dims[0], 2e9, 5e-6}};
          }
          std::vector<int> order(p);
          std::iota(order.begin(), order.end(), 0);
          std::shuffle(order.begin(), order.end(),
                       std::mt19937(static_cast<unsigned>(op_id)));
          std::vector<const void*> ins;
          std::vector<void*> outs;
          for (int r = 0; r < p; ++r) {
            ins.push_back(in[r].data());
            outs.push_back(in_place ? in[r].data() : out[r].data());
          }
          CHECK(run_ranks(order, jaxring::OpKey{2, op_id++, 0}, desc, ins, outs,
                          30.0)
                    .empty());
          for (int r = 0; r < p; ++r) CHECK((in_place ? in : out)[r] == expect);
        }
  CHECK(jaxring::inprocess_plan_pending_ops() == 0);
  // The loosest tier a transfer crosses: 2 hosts of 4.
  jaxring::OpDesc desc;
  desc.world_size = 8;
  desc.link = {{4, 1e9, 0}, {2, 1e8, 0}};
  CHECK(jaxring::crossed_tier(desc, 0, 3) == 0);
  CHECK(jaxring::crossed_tier(desc, 3, 4) == 1);
  CHECK(jaxring::crossed_tier(desc, 7, 0) == 1);
}

// The stream-ordered schedule (what the CUDA backend enqueues) run over
// memory with NCCL's matching rule: a send completes when the receiving
// rank's stream has reached the receive of the same unit from it, and an
// exchange ends once its send and its receive have. Every rank must finish
// (no deadlock), reduce receives must fit the scratch the schedule sizes,
// and the results must be the executor's bits.
std::vector<std::vector<float>> stream_ordered_allreduce(
    const jaxring::TieredPlan& plan,
    const std::vector<std::vector<float>>& in) {
  const int p = plan.world_size();
  std::vector<std::vector<float>> out = in;
  struct Stream {
    std::vector<jaxring::StreamExchange> xs;
    size_t next = 0;
    bool sent = false, received = false;
    std::vector<float> scratch;
  };
  for (int r = 0; r < plan.num_rings(); ++r) {
    std::vector<Stream> s(p);
    for (int rank = 0; rank < p; ++rank) {
      s[rank].xs = jaxring::stream_exchanges(plan, r, rank);
      s[rank].scratch.resize(jaxring::largest_reduce_receive(plan, rank));
      for (const auto& x : s[rank].xs) {
        // Within one exchange the two spans never overlap, so a stream may
        // run the send and the receive side by side.
        const bool apart = x.send.offset + x.send.count <= x.recv.offset ||
                           x.recv.offset + x.recv.count <= x.send.offset ||
                           x.send.count == 0 || x.recv.count == 0;
        CHECK(apart);
      }
    }
    for (bool progress = true; progress;) {
      progress = false;
      for (int a = 0; a < p; ++a) {
        Stream& me = s[a];
        if (me.next == me.xs.size()) continue;
        const jaxring::StreamExchange& x = me.xs[me.next];
        if (x.recv.count == 0) me.received = true;
        if (!me.sent && x.send.count == 0) me.sent = true;
        if (!me.sent) {
          Stream& peer = s[x.to];
          if (peer.next < peer.xs.size() && !peer.received) {
            const jaxring::StreamExchange& y = peer.xs[peer.next];
            if (y.phase == x.phase && y.unit == x.unit && y.from == a) {
              CHECK(y.recv.offset == x.send.offset &&
                    y.recv.count == x.send.count);
              float* dst = out[x.to].data() + y.recv.offset;
              const float* src = out[a].data() + x.send.offset;
              if (y.reduce) {
                CHECK(y.recv.count <=
                      static_cast<int64_t>(peer.scratch.size()));
                std::copy(src, src + x.send.count, peer.scratch.data());
                jaxring::reduce(jaxring::ElemType::kF32,
                                jaxring::ReduceOp::kSum, dst, dst,
                                peer.scratch.data(), y.recv.count);
              } else {
                std::copy(src, src + x.send.count, dst);
              }
              peer.received = true;
              me.sent = true;
              progress = true;
            }
          }
        }
        if (me.sent && me.received) {
          ++me.next;
          me.sent = me.received = false;
          progress = true;
        }
      }
    }
    for (int rank = 0; rank < p; ++rank)
      CHECK(s[rank].next == s[rank].xs.size());
  }
  return out;
}

void run_stream_schedule_tests() {
  const std::vector<std::vector<int>> topologies = {
      {2}, {3}, {5}, {8}, {2, 4}, {4, 2}, {2, 2, 2}, {1, 3}};
  int64_t op_id = 70000;
  for (const auto& dims : topologies)
    for (int rings : {1, 3})
      for (int64_t count : {0, 1, 7, 1000, 100003}) {
        int p = 1;
        for (int d : dims) p *= d;
        const int64_t chunk_bytes = 1024;
        jaxring::OpDesc desc;
        desc.num_rings = rings;
        desc.chunk_bytes = chunk_bytes;
        if (dims.size() > 1) desc.topology = dims;
        std::vector<std::string> errors;
        double wall = 0;
        // float_allreduce's inputs, made again from the same seed.
        std::vector<std::vector<float>> in(p, std::vector<float>(count));
        std::mt19937 gen(static_cast<unsigned>(op_id));
        std::normal_distribution<float> normal(0.f, 1e3f);
        for (auto& v : in)
          for (auto& x : v) x = normal(gen);
        const auto executed =
            float_allreduce(p, count, desc, op_id, 30, &errors, &wall);
        CHECK(errors.empty());
        const jaxring::TieredPlan plan(dims, rings, count, 4, chunk_bytes);
        const auto streamed = stream_ordered_allreduce(plan, in);
        for (int r = 0; r < p; ++r) {
          const bool same =
              count == 0 || std::memcmp(executed[r].data(), streamed[r].data(),
                                        count * 4) == 0;
          if (!same) {
            std::fprintf(stderr,
                         "stream order differs: dims %zu-tier p=%d rings=%d "
                         "count=%lld rank %d\n",
                         dims.size(), p, rings, static_cast<long long>(count),
                         r);
          }
          CHECK(same);
        }
        ++op_id;
      }
}

// The emulated link's timeline: first come first served per booking, but a
// transfer ready while the link is idle uses a gap that fits it.
void run_link_timeline_tests() {
  jaxring::LinkTimeline link;
  auto book = [&link](int64_t ready, int64_t busy) {
    return link.book(ready, busy, 0);
  };
  CHECK(book(100, 10) == 100);   // [100, 110)
  CHECK(book(100, 10) == 110);   // queued behind it: [110, 120)
  CHECK(book(200, 10) == 200);   // [200, 210), a gap before it
  CHECK(book(105, 50) == 120);   // fits in [120, 200): [120, 170)
  CHECK(book(150, 40) == 210);   // [170, 200) is too short: after
  CHECK(book(170, 30) == 170);   // exactly fills the gap
  CHECK(book(0, 0) == 0);        // an empty unit on an idle link
  CHECK(book(100, 0) == 250);    // ... and on a busy one waits
  CHECK(link.intervals() == 1);  // [100, 250): joined as they touched
  CHECK(book(250, 5) == 250);
  // Bookings run ahead of the real time (an operation is booked whole):
  // nothing still ahead of it is forgotten, however far ahead others go.
  const int64_t s = 1'000'000'000;
  jaxring::LinkTimeline ahead;
  CHECK(ahead.book(0, 10, 0) == 0);
  CHECK(ahead.book(3 * s, 10, 0) == 3 * s);
  CHECK(ahead.book(0, 10, 0) == 10);  // [0, 10) is still known
  // Once the real time is past the history, old intervals go, and a
  // transfer ready before the horizon counts as ready at it.
  CHECK(ahead.book(0, 10, 4 * s) == 4 * s - jaxring::LinkTimeline::kHistoryNs);
  CHECK(ahead.intervals() == 2);
}

void run_gang_tests() {
  using Clock = std::chrono::steady_clock;
  {
    std::vector<std::thread> ranks;
    std::atomic<int> all{0};
    for (int r = 0; r < 4; ++r)
      ranks.emplace_back(
          [&] { all += jaxring::gang_start_wait({7, 1, 0}, 4, 10.0); });
    for (auto& t : ranks) t.join();
    CHECK(all.load() == 4);
    CHECK(jaxring::gang_start_pending() == 0);
  }
  {
    // Rank 0 of op 2 gathers; a rank of op 3 arrives meanwhile and passes.
    std::atomic<bool> op2_done{false};
    std::thread waiter([&] {
      CHECK(jaxring::gang_start_wait({7, 2, 0}, 2, 10.0));
      op2_done = true;
    });
    while (jaxring::gang_start_pending() == 0) std::this_thread::yield();
    const auto t0 = Clock::now();
    CHECK(!jaxring::gang_start_wait({7, 3, 0}, 2, 10.0));
    CHECK(Clock::now() - t0 < std::chrono::seconds(5));
    CHECK(!op2_done.load());
    CHECK(jaxring::gang_start_wait({7, 2, 0}, 2, 10.0));  // the last arrival
    waiter.join();
    CHECK(op2_done.load());
    // Op 3's second rank finds its first one counted and does not wait.
    CHECK(jaxring::gang_start_wait({7, 3, 0}, 2, 10.0));
    CHECK(jaxring::gang_start_pending() == 0);
  }
  {
    // A rank that never comes: the wait ends after max_wait_s, unfulfilled.
    const auto t0 = Clock::now();
    CHECK(!jaxring::gang_start_wait({7, 4, 0}, 2, 0.2));
    const auto waited = Clock::now() - t0;
    CHECK(waited >= std::chrono::milliseconds(190));
    CHECK(waited < std::chrono::seconds(5));
  }
}

bool in_dev_shm(const std::string& name) {
  return ::access(("/dev/shm" + name).c_str(), F_OK) == 0;
}

// Forks a child that makes a host segment and a link's ring of `job`,
// writes their names on a pipe, and then runs `then` (which must not
// return). *names gets the two names; returns the child's pid.
pid_t fork_creator(const std::string& job, std::vector<std::string>* names,
                   void (*then)(int fd)) {
  int fds[2];
  if (::pipe(fds) != 0) return -1;
  const pid_t pid = fork();
  if (pid == 0) {
    ::close(fds[0]);
    std::string error;
    auto seg = jaxring::HostSegment::create(job, 0, 2, 2, &error);
    auto ring = jaxring::ShmRing::create(job, 0, 1, 0, &error);
    const jaxring::ShmOffer offer = ring ? ring->offer() : jaxring::ShmOffer{};
    const std::string text = (seg ? seg->name() : "") + "\n" +
                             std::string(offer.name, offer.name_bytes) + "\n";
    if (::write(fds[1], text.data(), text.size()) !=
        static_cast<ssize_t>(text.size())) {
      _exit(2);
    }
    then(
        fds[1]);  // seg and ring are never destroyed: nothing unlinks them here
    _exit(4);
  }
  ::close(fds[1]);
  std::string text;
  char buf[512];
  ssize_t n;
  while (std::count(text.begin(), text.end(), '\n') < 2 &&
         (n = ::read(fds[0], buf, sizeof buf)) > 0) {
    text.append(buf, static_cast<size_t>(n));
  }
  ::close(fds[0]);
  const size_t nl = text.find('\n');
  names->push_back(text.substr(0, nl));
  names->push_back(nl == std::string::npos
                       ? ""
                       : text.substr(nl + 1, text.find('\n', nl + 1) - nl - 1));
  return pid;
}

// What each way out of a segment's creator leaves in /dev/shm, and what the
// next job's sweep removes. Forks: runs while this process has no threads.
void run_segment_exit_tests() {
  const std::vector<jaxring::SegmentReader> readers = {
      jaxring::HostSegment::read_creator, jaxring::ShmRing::read_creator};
  auto reap = [](pid_t pid) {
    int status = 0;
    return ::waitpid(pid, &status, 0) == pid ? status : -1;
  };
  // SIGTERM with its default action: the handler removes the names, then
  // the process ends by the signal as it would have.
  {
    std::vector<std::string> names;
    const pid_t pid = fork_creator("core-tests-sigterm", &names, [](int) {
      ::raise(SIGTERM);
      _exit(3);
    });
    const int status = reap(pid);
    CHECK(WIFSIGNALED(status) && WTERMSIG(status) == SIGTERM);
    CHECK(names.size() == 2 && !names[0].empty() && !names[1].empty());
    for (const auto& name : names) CHECK(!in_dev_shm(name));
  }
  // exit() without destroying either segment: the atexit handler removes them.
  {
    std::vector<std::string> names;
    const pid_t pid =
        fork_creator("core-tests-exit", &names, [](int) { std::exit(0); });
    const int status = reap(pid);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    for (const auto& name : names) CHECK(!in_dev_shm(name));
  }
  // Killed outright (_exit runs no handler, like SIGKILL): both stay, until
  // a sweep finds their creator gone. A live creator's segments, and a
  // file of this user that is not a segment of this build, stay.
  std::vector<std::string> dead, live;
  const pid_t dead_pid =
      fork_creator("core-tests-dead", &dead, [](int) { _exit(0); });
  reap(dead_pid);  // reaped: a zombie's pid still answers kill(pid, 0)
  for (const auto& name : dead) CHECK(in_dev_shm(name));
  const pid_t live_pid = fork_creator("core-tests-live", &live, [](int) {
    for (;;) ::pause();  // until the SIGTERM below
  });
  const std::string foreign = "/jaxring-core-tests-foreign";
  const int fd = ::shm_open(foreign.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  CHECK(fd >= 0 && ::ftruncate(fd, 1 << 16) == 0);
  if (fd >= 0) ::close(fd);
  const std::vector<std::string> removed =
      jaxring::remove_stale_segments(readers);
  auto was_removed = [&](const std::string& name) {
    return std::find(removed.begin(), removed.end(), name) != removed.end();
  };
  for (const auto& name : dead) CHECK(was_removed(name) && !in_dev_shm(name));
  for (const auto& name : live) CHECK(!was_removed(name) && in_dev_shm(name));
  CHECK(!was_removed(foreign) && in_dev_shm(foreign));
  ::shm_unlink(foreign.c_str());
  // The live creator's names go with it.
  ::kill(live_pid, SIGTERM);
  const int status = reap(live_pid);
  CHECK(WIFSIGNALED(status) && WTERMSIG(status) == SIGTERM);
  for (const auto& name : live) CHECK(!in_dev_shm(name));
}

// The shared-memory ring on its own: who may map it, what it carries, and
// how a sender waits for room.
void run_shm_ring_tests() {
  const std::string job_id(16, 'j');
  std::string error;
  auto tx = jaxring::ShmRing::create(job_id, 1, 0, 3, &error);
  CHECK(tx != nullptr);
  if (!tx) {
    std::fprintf(stderr, "no shared-memory ring: %s\n", error.c_str());
    return;
  }
  const jaxring::ShmOffer offer = tx->offer();
  // Only the link it was made for may map it: not the other direction,
  // another ring, or another job.
  CHECK(!jaxring::ShmRing::open(offer, job_id, 0, 1, 3, &error));
  CHECK(!jaxring::ShmRing::open(offer, job_id, 1, 0, 4, &error));
  CHECK(!jaxring::ShmRing::open(offer, std::string(16, 'k'), 1, 0, 3, &error));
  jaxring::ShmOffer forged = offer;
  forged.capacity *= 2;
  CHECK(!jaxring::ShmRing::open(forged, job_id, 1, 0, 3, &error));
  auto rx = jaxring::ShmRing::open(offer, job_id, 1, 0, 3, &error);
  CHECK(rx != nullptr);
  if (!rx) return;
  tx->unlink();
  const std::string name(offer.name, offer.name_bytes);
  CHECK(shm_open(name.c_str(), O_RDONLY, 0) < 0 && errno == ENOENT);
  int fds[2];  // the connection beside the ring
  CHECK(socketpair(AF_UNIX, SOCK_STREAM, 0, fds) == 0);
  const auto always = [] { return true; };
  // Nothing written yet: the receiver refuses to read.
  CHECK(rx->next(16, &error) == nullptr);
  CHECK(!tx->carries(0) && !tx->carries(tx->capacity() / 2 + 1));
  // Payloads of many sizes, wrapping the ring many times, come out whole.
  std::mt19937 rng(7);
  for (int i = 0; i < 300; ++i) {
    const int64_t n = 1 + static_cast<int64_t>(rng() % (tx->capacity() / 2));
    std::vector<char> data(static_cast<size_t>(n), static_cast<char>(i));
    data[0] = 'a';
    data[n - 1] = 'z';
    CHECK(tx->put(data.data(), n, fds[0], 1.0, always, &error) ==
          jaxring::ShmRing::Put::kDone);
    const char* got = rx->next(n, &error);
    CHECK(got != nullptr &&
          std::memcmp(got, data.data(), static_cast<size_t>(n)) == 0);
    rx->release(n);
  }
  // A full ring: the sender gives up when its operation is gone, and fails
  // when the peer's connection closes, without writing.
  const int64_t half = tx->capacity() / 2;
  std::vector<char> big(static_cast<size_t>(half), 1);
  int done = 0;
  jaxring::ShmRing::Put put = jaxring::ShmRing::Put::kDone;
  while (put == jaxring::ShmRing::Put::kDone && done < 4) {
    put = tx->put(big.data(), half, fds[0], 1.0, [] { return false; }, &error);
    done += put == jaxring::ShmRing::Put::kDone;
  }
  CHECK(put == jaxring::ShmRing::Put::kGaveUp && done >= 1 && done <= 2);
  close(fds[1]);
  CHECK(tx->put(big.data(), half, fds[0], 5.0, always, &error) ==
        jaxring::ShmRing::Put::kFailed);
  CHECK(error.find("closed") != std::string::npos);
  close(fds[0]);
  // The receiver frees room, and the sender goes on.
  for (int k = 0; k < done; ++k) {
    CHECK(rx->next(half, &error) != nullptr);
    rx->release(half);
  }
  CHECK(socketpair(AF_UNIX, SOCK_STREAM, 0, fds) == 0);
  CHECK(tx->put(big.data(), half, fds[0], 1.0, always, &error) ==
        jaxring::ShmRing::Put::kDone);
  close(fds[0]);
  close(fds[1]);
}

int main() {
  // First: forking is only safe before any thread exists.
  run_dispatch_tests();
  run_host_direct_test();
  run_tcp_test();
  run_shm_ring_tests();
  run_segment_exit_tests();
  run_host_layout_test();

  for (int p = 1; p <= 9; ++p)
    for (int rings = 1; rings <= 4; ++rings)
      for (int64_t count : {0, 1, 7, 100, 1000})
        check_plan(p, rings, count, 12);

  // The 16-bit conversions round-trip every finite value.
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float f = jaxring::half_to_float(static_cast<uint16_t>(h));
    if (f == f) CHECK(jaxring::float_to_half(f) == h);
    const float b = jaxring::bfloat16_to_float(static_cast<uint16_t>(h));
    if (b == b) CHECK(jaxring::float_to_bfloat16(b) == h);
  }

  int64_t op_id = 1;
  for (int p : {2, 3, 5, 8})
    for (int rings : {1, 2, 3})
      for (int64_t count : {0, 1, 17, 1000, 100003})
        for (int64_t chunk : {4, 256, 1 << 20}) {
          if (chunk == 4 && count > 1000) continue;  // keeps TSan quick
          const int id = op_id++;
          run_allreduce(p, rings, count, chunk, id, static_cast<unsigned>(id));
        }
  // The direct algorithm, into separate outputs and in place.
  for (int p : {2, 3, 5, 8})
    for (int64_t count : {0, 1, 17, 1000, 100003})
      for (bool in_place : {false, true}) {
        const int id = op_id++;
        run_allreduce(p, 2, count, 1 << 20, id, static_cast<unsigned>(id),
                      jaxring::Algorithm::kDirect, in_place);
      }
  // Several operations in flight at once, started in different orders.
  {
    std::vector<std::thread> ops;
    for (int k = 0; k < 6; ++k)
      ops.emplace_back([k] {
        run_allreduce(
            4, 2, 5000 + k, 512, 1000 + k, k,
            k % 2 ? jaxring::Algorithm::kDirect : jaxring::Algorithm::kRing);
      });
    for (auto& t : ops) t.join();
  }
  // Link emulation, ints: exact sums, into separate outputs and in place.
  for (int p : {2, 3, 8})
    for (int64_t count : {0, 1, 17, 100003})
      for (bool in_place : {false, true}) {
        const int id = op_id++;
        run_allreduce(p, 2, count, 4096, id, static_cast<unsigned>(id),
                      jaxring::Algorithm::kRing, in_place, /*link=*/10e9);
      }
  run_emulation_tests();
  run_tiered_tests();
  run_stream_schedule_tests();
  run_link_timeline_tests();
  run_gang_tests();
  // A released buffer comes back for the next request of its size; the pool
  // never holds more than its cap.
  {
    const int64_t before = jaxring::pooled_bytes();
    char* first = nullptr;
    {
      jaxring::PooledBuffer a = jaxring::acquire_buffer(12345);
      first = a.get();
      std::memset(a.get(), 1, 12345);
    }
    CHECK(jaxring::pooled_bytes() == before + 12345);
    {
      jaxring::PooledBuffer b = jaxring::acquire_buffer(12345);
      CHECK(b.get() == first);
      CHECK(jaxring::pooled_bytes() == before);
      jaxring::PooledBuffer c = jaxring::acquire_buffer(12345);
      CHECK(c.get() != first);
    }
    CHECK(jaxring::pooled_bytes() == before + 2 * 12345);
    {
      const size_t huge = static_cast<size_t>(jaxring::kMaxPooledBytes);
      jaxring::PooledBuffer d = jaxring::acquire_buffer(huge);
    }
    CHECK(jaxring::pooled_bytes() == before + 2 * 12345);
  }
  // A rank that never arrives: the others fail after the timeout, naming it
  // (the ring, the direct algorithm, the ring under link emulation).
  for (int kind = 0; kind < 3; ++kind) {
    const auto algorithm =
        kind == 1 ? jaxring::Algorithm::kDirect : jaxring::Algorithm::kRing;
    jaxring::OpDesc desc;
    if (kind == 2) desc.link = {{3, 1e9, 0}};
    desc.type = jaxring::ElemType::kF32;
    desc.count = 10;
    desc.world_size = 3;
    desc.algorithm = algorithm;
    std::vector<float> a(10, 1), b(10, 1), oa(10), ob(10);
    Done done;
    done.remaining = 2;
    auto cb = [&](const std::optional<std::string>& err) {
      std::lock_guard<std::mutex> lock(done.mu);
      if (err) done.errors.push_back(*err);
      if (--done.remaining == 0) done.cv.notify_all();
    };
    const jaxring::OpKey key{2, 1, kind};
    jaxring::inprocess_allreduce(key, desc, 0, 0, a.data(), oa.data(), 0.3, cb);
    jaxring::inprocess_allreduce(key, desc, 1, 1, b.data(), ob.data(), 0.3, cb);
    std::unique_lock<std::mutex> lock(done.mu);
    done.cv.wait(lock, [&] { return done.remaining == 0; });
    CHECK(done.errors.size() == 2);
    for (const auto& e : done.errors)
      CHECK(e.find("rank(s) 2 of 3 never arrived") != std::string::npos);
  }
  // Last, since it is for good: at exit no handshake may start (libcrypto
  // frees its state in an atexit handler), on either side.
  {
    const jaxring::JobIdentity job = test_job(0);
    CHECK(!jaxring::handshake_mac(job, true, "n", "m", 0, 1, 0).empty());
    CHECK(jaxring::close_handshakes(1.0) && jaxring::handshakes_closed());
    CHECK(jaxring::handshake_mac(job, true, "n", "m", 0, 1, 0).empty());
    int fds[2];
    CHECK(socketpair(AF_UNIX, SOCK_STREAM, 0, fds) == 0);
    std::string error;
    const auto deadline =
        std::chrono::steady_clock::now() + std::chrono::seconds(1);
    CHECK(!jaxring::connect_handshake(fds[0], job, 1, 0, deadline, &error));
    CHECK(error.find("exiting") != std::string::npos);
    int process = -1, channel = -1;
    CHECK(!jaxring::accept_handshake(fds[1], job, deadline, &process, &channel,
                                     &error));
    close(fds[0]);
    close(fds[1]);
  }
  if (failures) {
    std::fprintf(stderr, "%d check(s) failed\n", failures);
    return 1;
  }
  std::printf("core tests: all checks passed\n");
  return 0;
}
