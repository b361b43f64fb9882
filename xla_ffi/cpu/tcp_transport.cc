#include "tcp_transport.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <stdexcept>
#include <system_error>
#include <sstream>
#include <thread>
#include <utility>
#include <vector>

#include "../failure.h"
#include "../tiered_plan.h"
#include "huge_pages.h"
#include "socket_io.h"
#include "tcp_handshake.h"
#include "task_queue.h"
#include "timeline.h"
#include "wire_format.h"

namespace jaxring {

namespace {

constexpr auto kDeadlinePoll = std::chrono::milliseconds(20);
// How long a connection may take to open, and an abort frame to leave.
constexpr double kConnectTimeoutS = 30.0;
// How long an accepted connection has to prove itself, and how many may be
// at it at once (a job needs at most processes x rings connections, opened
// once; strangers must not hold threads for longer, or more of them).
constexpr double kHandshakeTimeoutS = 10.0;
constexpr int kMaxHandshakes = 64;
constexpr double kAbortSendTimeoutS = 10.0;
// How long a rank must have waited without progress before it checks
// whether a peer runs another program at its call site (and how often it
// checks again). A peer merely ahead, in the next program, is the normal
// case; one that never sent this operation anything and has been waiting
// at the same call site with another description for this long is not.
constexpr auto kMismatchProbeAfter = std::chrono::seconds(1);
// How long a failed rank waits for its abort frames to leave.
constexpr auto kAbortFlush = std::chrono::seconds(1);
// After one connection of a peer closes, how long before the peer is
// declared lost: its other connections may still hold an abort frame that
// names the real cause (a process exits right after its allreduce failed).
constexpr auto kLostPeerGrace = std::chrono::milliseconds(100);
// Payload is received in slices so a failed operation is noticed quickly.
constexpr size_t kRecvSlice = 1 << 20;
// What frames for operations this process has not started may make it hold
// (a peer that runs ahead is normal; one that runs thousands of operations
// ahead, or stages gigabytes, is not): operations created by frames, bytes
// staged from the wire, and how much of a peer's abort message is kept.
// Frames beyond these fail their operation with an error that says so.
constexpr int kMaxFrameCreatedOps = 4096;
constexpr int64_t kMaxStagedFromWire = int64_t{8} << 30;
constexpr size_t kMaxKeptMessage = 4096;
// How long an operation created by frames waits for a local rank to start
// it before it is dropped, until a local call says otherwise (jaxring's
// default timeout_s).
constexpr double kDefaultTimeoutS = 300.0;

// ---- staging buffers ---------------------------------------------------------

// Buffers for chunks that arrive before their rank joined. They are reused:
// fresh large allocations come as new pages from the kernel, and faulting
// them in costs about as much as receiving into them.
class StagingPool {
 public:
  static StagingPool& get() {
    static StagingPool* p = new StagingPool();  // leaked, like the workers
    return *p;
  }
  std::unique_ptr<char[]> take(size_t n) {
    in_use_ += static_cast<int64_t>(n);
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = free_.find(n);
      if (it != free_.end()) {
        std::unique_ptr<char[]> b = std::move(it->second);
        free_.erase(it);
        held_ -= n;
        return b;
      }
    }
    return std::unique_ptr<char[]>(new char[std::max<size_t>(n, 1)]);
  }
  void give(size_t n, std::unique_ptr<char[]> b) {
    in_use_ -= static_cast<int64_t>(n);
    std::lock_guard<std::mutex> lock(mu_);
    if (held_ + n > kMaxHeld) return;  // freed here
    held_ += n;
    free_.emplace(n, std::move(b));
  }

 public:
  // Bytes of staged chunks not yet consumed.
  int64_t in_use() const { return in_use_.load(); }

 private:
  static constexpr size_t kMaxHeld = size_t{256} << 20;
  std::atomic<int64_t> in_use_{0};
  std::mutex mu_;
  std::multimap<size_t, std::unique_ptr<char[]>> free_;
  size_t held_ = 0;
};

// A staged chunk: its bytes and their count (to return it to the pool).
struct Staged {
  Staged() = default;
  explicit Staged(size_t n) : size(n), data(StagingPool::get().take(n)) {}
  Staged(Staged&&) = default;
  Staged& operator=(Staged&& o) {
    release();
    size = o.size;
    data = std::move(o.data);
    from_process = o.from_process;
    return *this;
  }
  ~Staged() { release(); }
  void release() {
    if (data) StagingPool::get().give(size, std::move(data));
  }
  size_t size = 0;
  std::unique_ptr<char[]> data;
  // The process whose connection brought it: checked against the plan once
  // a local rank joins and says which process runs each rank.
  int from_process = -1;
};

// ---- operations ------------------------------------------------------------

class TcpWorker;

// Units of one (local rank, ring) received from the previous ranks.
struct Inbox {
  bool created = false;
  // The phase whose units may be written straight into the rank's result.
  // A unit of a later phase is staged: its element range may still be in
  // use by this one (see tiered_plan.h).
  int phase = 0;
  // Per phase: units whose data is here and not yet reduced/stored, in
  // arrival order. Units of a phase are independent on the receiving side
  // (each writes its own chunk of the result), so they are consumed as
  // they come: a chunk of step t+1 never waits behind one of step t still
  // on the wire.
  std::map<int, std::deque<int64_t>> ready;
  std::map<int, int64_t> arrived;  // per phase (for timeout messages)
  // (phase, unit)s that came before the rank joined or reached their phase.
  std::map<std::pair<int, int64_t>, Staged> staged;
  // Every (phase, unit) accepted so far, staged or written straight into the
  // result: the plan sends each once, so a second copy is refused rather
  // than counted again (a rank would then finish with a unit missing).
  std::set<std::pair<int, int64_t>> received;
};

// A rank of the operation that runs in this process.
struct LocalRank {
  const void* in = nullptr;
  void* out = nullptr;
  TcpWorker* worker = nullptr;
  int device = 0;
  int64_t joined_ns = 0;
  int outstanding_sends = 0;  // frames queued that still read our buffers
  // Per ring, with a tiered plan: the rank's own contribution to the phase
  // it runs (a copy of the previous phase's result), covering the shard of
  // phase 1, which holds every later one, from own_offset on.
  std::vector<std::unique_ptr<char[]>> own;
  std::vector<int64_t> own_offset;
};

struct TcpOp {
  explicit TcpOp(const OpKey& k) : key(k) {}

  const OpKey key;
  std::mutex mu;  // guards everything below
  bool has_desc = false;
  OpDesc desc;
  std::unique_ptr<TieredPlan> plan;
  std::vector<int> process_of_rank;  // set by the first local rank to join
  int expected_locals = 0;
  int completed_locals = 0;
  std::map<int, LocalRank> locals;
  std::map<std::pair<int, int>, Inbox> inboxes;  // (rank, ring)
  // Until a local rank joins: when an operation created by frames expires
  // (see Transport::op_for_frame).
  Clock::time_point deadline = after_seconds(kDefaultTimeoutS);
  double timeout_s = kDefaultTimeoutS;
  bool failed = false;
  std::atomic<bool> failed_flag{false};  // readable without mu by the I/O
  std::string error;
  int writers = 0;  // readers currently receiving into a local buffer
  int first_sender = -1;  // process whose frame created it, if one did
  std::set<int> heard_from;  // processes whose data frames it accepted
  // Abort frames this process queued for the operation and not yet written;
  // a failed rank completes once they are out (or kAbortFlushS passed), so
  // peers learn the cause even if this process exits right after.
  std::atomic<int> aborts_in_flight{0};
  Clock::time_point failed_at;

  // Requires mu. Throws std::invalid_argument on a description no plan
  // fits (a topology whose product is not the world size).
  void set_desc(const OpDesc& d) {
    std::vector<int> dims = d.topology;
    if (dims.empty()) dims.push_back(d.world_size);
    int64_t product = 1;
    for (int t : dims) {
      if (t < 1 || product > d.world_size) break;  // stays far from overflow
      product *= t;
    }
    if (product != d.world_size) {
      throw std::invalid_argument("the topology does not multiply to the "
                                  "world size");
    }
    plan.reset(new TieredPlan(dims, d.num_rings, d.count, elem_bytes(d.type),
                              d.chunk_bytes));
    desc = d;
    has_desc = true;
  }
  // Requires mu.
  Inbox& inbox(int rank, int ring) {
    Inbox& ib = inboxes[{rank, ring}];
    ib.created = true;
    return ib;
  }
  // Requires mu, a plan and process_of_rank. Whether the plan has process p
  // send data to a rank of this process: only such a process can prove, by
  // sending nothing here and something elsewhere, that it runs another
  // program (a process upstream of none of ours may legitimately finish
  // and move on without a word to us; so may one whose every unit to us is
  // empty, for a buffer smaller than its ring's segments).
  bool expects_data_from(int p) const {
    for (const auto& [rank, local] : locals) {
      for (int ring = 0; ring < plan->num_rings(); ++ring) {
        for (int j = 0; j < plan->num_phases(); ++j) {
          const int prev = plan->prev_rank(ring, j, rank);
          if (prev == rank || process_of_rank[prev] != p) continue;
          const int64_t units = plan->num_units(ring, j, rank);
          for (int64_t u = 0; u < units; ++u) {
            if (plan->recv_span(ring, j, rank, u).count > 0) return true;
          }
        }
      }
    }
    return false;
  }
  std::string name() const {
    if (has_desc) return op_name(key, desc);
    std::ostringstream os;
    os << "jaxring allreduce (op " << key.op_id << ", group " << key.group
       << ", run " << key.run_id << ")";
    return os.str();
  }
};

struct Task {
  std::shared_ptr<TcpOp> op;
  int rank;
  Completion done;
  // Per ring: the phase this rank runs (num_phases once done), and how many
  // of its non-empty units are still to come.
  std::vector<int> phase;
  std::vector<int64_t> remaining;
  bool started = false;  // phase 0 entered on every ring
  // When this rank last consumed a unit (or joined), and when it may next
  // look for a peer running another program (see kMismatchProbeAfter).
  Clock::time_point last_progress = Clock::now();
  Clock::time_point next_probe = Clock::now();
};

class TcpWorker {
 public:
  explicit TcpWorker(int device) : device_(device) {
    // Lives for the whole process, like the in-process workers.
    std::thread([this] { loop(); }).detach();
  }
  void submit(Task t) { queue_.submit(std::move(t)); }
  void wake() { queue_.wake(); }

 private:
  void loop();
  bool advance(Task& task, bool* finished);

  const int device_;
  TaskQueue<Task> queue_;
};

// A frame waiting to be written to one connection.
struct OutFrame {
  FrameHeader header{};  // zeroed: no stray bytes of this process on the wire
  const char* data = nullptr;  // points into a local rank's buffer
  std::shared_ptr<TcpOp> op;   // null for abort frames
  std::shared_ptr<TcpOp> abort_of;  // an abort frame's operation
  int rank = -1;               // whose outstanding_sends this holds
  std::string message;         // an abort frame's payload
  double stall_s = kAbortSendTimeoutS;
};

void release_send(const OutFrame& f);

// The connection to one process for one ring, with its sender thread.
class OutLink {
 public:
  OutLink(int process, int channel, std::string address, JobIdentity identity)
      : process_(process), channel_(channel), address_(std::move(address)),
        identity_(std::move(identity)) {
    std::thread([this] { loop(); }).detach();
  }
  // Returns false if the link is already dead (the frame is not taken).
  bool enqueue(OutFrame f) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (dead_) return false;
      queue_.push_back(std::move(f));
    }
    cv_.notify_one();
    return true;
  }
  // Takes op's data frames out of the queue. A frame being written stays
  // (the stream must stay whole); the loop finishes it from a copy.
  std::vector<OutFrame> take_frames_of(const TcpOp* op) {
    std::vector<OutFrame> taken;
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = queue_.begin(); it != queue_.end();) {
      if (it->op.get() == op) {
        taken.push_back(std::move(*it));
        it = queue_.erase(it);
      } else {
        ++it;
      }
    }
    return taken;
  }

 private:
  void loop();
  void die(const std::string& why);

  const int process_;
  const int channel_;
  const std::string address_;
  const JobIdentity identity_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<OutFrame> queue_;
  bool dead_ = false;
};

class Transport {
 public:
  static Transport& get() {
    // Leaked on purpose: threads may use it during interpreter shutdown.
    static Transport* t = new Transport();
    return *t;
  }

  // Opens the listener; from then on a connection is let in only after it
  // proved `identity`'s job (tcp_handshake.h).
  int listen(const std::string& bind_host, const JobIdentity& identity,
             std::string* error);
  // Where every process listens; false (with *error) if listen() has not
  // run or the count differs from the job's.
  bool set_peers(const std::vector<std::string>& addresses, std::string* error) {
    const JobIdentity id = identity();
    if (id.processes == 0) {
      *error = "tcp_set_peers before tcp_listen";
      return false;
    }
    if (static_cast<int>(addresses.size()) != id.processes) {
      *error = "got " + std::to_string(addresses.size()) + " addresses for a job of " +
               std::to_string(id.processes) + " processes";
      return false;
    }
    std::lock_guard<std::mutex> lock(links_mu_);
    addresses_ = addresses;
    me_.store(id.process);
    return true;
  }
  JobIdentity identity() {
    std::lock_guard<std::mutex> lock(identity_mu_);
    return identity_;
  }
  TcpTransportInfo info();
  int me() const { return me_.load(); }

  TcpWorker* worker(int device) {
    std::lock_guard<std::mutex> lock(mu_);
    auto& w = workers_[device];
    if (!w) w.reset(new TcpWorker(device));
    return w.get();
  }

  // The operation for key, created if new.
  std::shared_ptr<TcpOp> op(const OpKey& key) {
    std::lock_guard<std::mutex> lock(mu_);
    collect_garbage();
    auto& slot = ops_[key];
    if (!slot) slot = std::make_shared<TcpOp>(key);
    return slot;
  }
  // The operation a frame is for: created if new, unless frames already
  // made kMaxFrameCreatedOps operations that no local rank started (then
  // nullptr). A new one expires after the longest timeout local calls used
  // so far, if no local rank starts it.
  std::shared_ptr<TcpOp> op_for_frame(const OpKey& key) {
    std::lock_guard<std::mutex> lock(mu_);
    collect_garbage();
    auto it = ops_.find(key);
    if (it != ops_.end()) return it->second;
    if (frame_created_ops_ >= kMaxFrameCreatedOps) return nullptr;
    auto op = std::make_shared<TcpOp>(key);
    const double seen = frame_state_timeout_s_.load();
    const double t = seen > 0 ? seen : kDefaultTimeoutS;
    op->timeout_s = t;
    op->deadline = after_seconds(t);
    ops_[key] = op;
    ++frame_created_ops_;
    return op;
  }
  // A local call's timeout: frame-created operations live as long as the
  // longest one seen (kDefaultTimeoutS before any).
  void note_timeout(double timeout_s) {
    double seen = frame_state_timeout_s_.load();
    while (timeout_s > seen && !frame_state_timeout_s_.compare_exchange_weak(seen, timeout_s)) {
    }
  }
  void forget(const std::shared_ptr<TcpOp>& op) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = ops_.find(op->key);
    if (it != ops_.end() && it->second == op) ops_.erase(it);
  }
  int64_t pending() {
    std::lock_guard<std::mutex> lock(mu_);
    return static_cast<int64_t>(ops_.size());
  }
  // Registers an authenticated incoming connection; false if that process
  // already has one open for the channel.
  bool claim_inbound(int p, int channel) {
    std::lock_guard<std::mutex> lock(links_mu_);
    return inbound_.insert({p, channel}).second;
  }
  void release_inbound(int p, int channel) {
    std::lock_guard<std::mutex> lock(links_mu_);
    inbound_.erase({p, channel});
  }
  // `connection`: a connection was turned away (counted), not only a
  // condition noted.
  void note_refusal(const std::string& why, bool connection = true) {
    if (connection) ++refused_;
    std::lock_guard<std::mutex> lock(links_mu_);
    last_refusal_ = why;
  }
  // Why process p can no longer be reached, or "" if it can.
  std::string dead_reason(int p) {
    std::lock_guard<std::mutex> lock(links_mu_);
    auto it = dead_.find(p);
    return it == dead_.end() ? std::string() : it->second;
  }

  // Queues a frame to process p on ring channel; false if p is unreachable.
  bool send(int p, int channel, OutFrame f) {
    OutLink* link;
    {
      std::lock_guard<std::mutex> lock(links_mu_);
      if (dead_.count(p) || p < 0 ||
          p >= static_cast<int>(addresses_.size())) {
        return false;
      }
      auto& l = links_[{p, channel}];
      if (!l && handshakes_closed()) {  // exiting: no new connections
        links_.erase({p, channel});
        return false;
      }
      if (!l) {
        try {
          l.reset(new OutLink(p, channel, addresses_[p], identity()));
        } catch (const std::system_error& e) {
          // No thread for the link: this process's limit, not the peer's.
          dead_[p] = "this process (" + std::to_string(me()) +
                     ") cannot start a thread for the connection: " + e.what();
          links_.erase({p, channel});
          return false;
        }
      }
      link = l.get();
    }
    return link->enqueue(std::move(f));
  }

  // Process p cannot be reached: every operation that needs it fails, and
  // (tell_others) every other process hears so, including those that never
  // talk to p directly.
  void peer_lost(int p, const std::string& why, bool tell_others = true);
  // Fails op and any operation of the same slot (OpDesc::slot_id) and group
  // in another run or under another op id whose description differs while exactly one of the two has
  // ranks in this process, and the local one never heard from the process
  // that sent the other although its plan has that process send data here:
  // the processes compiled different programs. Run by a rank that has waited
  // kMismatchProbeAfter without progress.
  void check_programs_agree(const std::shared_ptr<TcpOp>& op);
  // Fails op and tells every other process of its group. Requires op.mu not
  // held. Returns whether this call failed it (false: it already was).
  bool fail(const std::shared_ptr<TcpOp>& op, const std::string& why,
            bool tell_peers);
  // Tells process p that the operation `key` failed here, for an operation
  // this process holds no state for.
  void send_abort(int p, const OpKey& key, FailureKind kind, const std::string& why) {
    OutFrame f;
    f.header.magic = kWireMagic;
    f.header.kind = kAbort;
    f.header.run_id = key.run_id;
    f.header.op_id = key.op_id;
    f.header.group = key.group;
    f.header.phase = static_cast<int32_t>(kind);
    f.header.src_rank = me();
    f.header.payload_bytes = static_cast<int64_t>(why.size());
    f.message = why;
    send(p, 0, std::move(f));
  }

 private:
  void accept_loop(int listen_fd);
  void read_loop(int fd);
  void collect_garbage();  // requires mu_

  // Lock order: mu_ may be held while taking an operation's mu (garbage
  // collection); an operation's mu may be held while taking links_mu_
  // (sending). Nothing takes mu_ while holding an operation's mu.
  // identity_mu_ is taken last, under any of them.
  std::mutex mu_;  // ops_, workers_, the listener and identity_
  int listen_fd_ = -1;
  int port_ = -1;
  std::string listen_host_;
  // Set once, by listen(). A lock of its own, taken last: senders read it
  // while holding an operation's mu.
  std::mutex identity_mu_;
  JobIdentity identity_;
  // Connections in their handshake (capped: a stranger may open many), and
  // those refused so far with the last reason (for transport_info).
  std::atomic<int> handshaking_{0};
  std::atomic<int64_t> refused_{0};
  std::string last_refusal_;  // under links_mu_
  // (process, channel) of every authenticated incoming connection: one each.
  std::set<std::pair<int, int>> inbound_;  // under links_mu_
  std::map<int, std::unique_ptr<TcpWorker>> workers_;
  std::map<OpKey, std::shared_ptr<TcpOp>> ops_;
  // Operations in ops_ that no local rank joined (counted by
  // collect_garbage), and how long such an operation may wait.
  int frame_created_ops_ = 0;
  std::atomic<double> frame_state_timeout_s_{0};
  std::mutex links_mu_;  // addresses_, links_, dead_, inbound_, last_refusal_
  std::atomic<int> me_{-1};
  std::vector<std::string> addresses_;
  std::map<std::pair<int, int>, std::unique_ptr<OutLink>> links_;
  std::map<int, std::string> dead_;
};

// Marks op failed under its lock; returns the workers to wake, or nothing if
// it had failed already.
bool Transport::fail(const std::shared_ptr<TcpOp>& op, const std::string& why,
                     bool tell_peers) {
  std::vector<TcpWorker*> wake;
  std::set<int> peers;
  FrameHeader h{};
  {
    std::lock_guard<std::mutex> lock(op->mu);
    if (op->failed) return false;
    op->failed = true;
    op->failed_flag.store(true);
    op->failed_at = Clock::now();
    op->error = why;
    for (auto& [rank, l] : op->locals) wake.push_back(l.worker);
    if (tell_peers) {
      for (int p : op->process_of_rank) {
        if (p != me()) peers.insert(p);
      }
      // Before a local rank joined, the process whose frame made it is
      // the one known to wait for it.
      if (op->process_of_rank.empty() && op->first_sender >= 0) {
        peers.insert(op->first_sender);
      }
      // Counted before any worker is woken, so a failed rank cannot
      // complete (and its process exit) before the aborts are written.
      op->aborts_in_flight.fetch_add(static_cast<int>(peers.size()));
    }
    h.magic = kWireMagic;
    h.kind = kAbort;
    h.run_id = op->key.run_id;
    h.op_id = op->key.op_id;
    h.group = op->key.group;
    h.payload_bytes = static_cast<int64_t>(why.size());
    // The kind and peer travel as numbers; the receiver tags from those.
    FailureKind kind = FailureKind::kInternal;
    int peer = -1;
    std::string rest;
    parse_tag(why, &kind, &peer, &rest);
    h.phase = static_cast<int32_t>(kind);
    h.src_rank = peer;
  }
  // Its frames still queued are dropped now: behind a frame that stalls
  // (a peer that stopped reading), they would keep its ranks from
  // completing for up to another timeout.
  std::vector<OutLink*> links;
  {
    std::lock_guard<std::mutex> lock(links_mu_);
    for (auto& [key, link] : links_) links.push_back(link.get());  // never freed
  }
  for (OutLink* link : links) {
    for (const OutFrame& f : link->take_frames_of(op.get())) release_send(f);
  }
  for (int p : peers) {
    OutFrame f;
    f.header = h;
    f.message = why;
    f.abort_of = op;
    if (!send(p, 0, std::move(f))) op->aborts_in_flight.fetch_sub(1);
  }
  for (TcpWorker* w : wake) w->wake();
  return true;
}

void Transport::peer_lost(int p, const std::string& why, bool tell_others) {
  if (p < 0) return;
  std::vector<std::shared_ptr<TcpOp>> affected;
  std::string reason;
  int processes;
  {
    std::lock_guard<std::mutex> lock(links_mu_);
    if (dead_.count(p)) return;
    processes = static_cast<int>(addresses_.size());
    if (tell_others) {
      std::ostringstream os;
      os << "process " << p << " ("
         << (p < processes ? addresses_[p] : std::string("?"))
         << ") is unreachable: " << why;
      reason = os.str();
    } else {
      reason = why;  // already phrased by the process that saw it
    }
    dead_[p] = reason;
  }
  if (tell_others) {
    // Sent before the operations' aborts on the same connections, so a
    // failed rank that waits for its aborts to leave also flushes these.
    for (int q = 0; q < processes; ++q) {
      if (q == p || q == me()) continue;
      OutFrame f;
      f.header.magic = kWireMagic;
      f.header.kind = kPeerLost;
      f.header.group = p;
      f.header.payload_bytes = static_cast<int64_t>(reason.size());
      f.message = reason;
      send(q, 0, std::move(f));
    }
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [key, op] : ops_) affected.push_back(op);
  }
  for (auto& op : affected) {
    bool involved;
    std::string name;
    {
      std::lock_guard<std::mutex> lock(op->mu);
      involved = std::find(op->process_of_rank.begin(),
                           op->process_of_rank.end(),
                           p) != op->process_of_rank.end();
      name = op->name();
    }
    if (involved) {
      fail(op, tagged(FailureKind::kPeerLost, p, name + ": " + reason),
           /*tell_peers=*/true);
    }
  }
}

void Transport::check_programs_agree(const std::shared_ptr<TcpOp>& op) {
  std::vector<std::shared_ptr<TcpOp>> same_site;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [k, other] : ops_) {
      if (k.group == op->key.group && other != op) {
        same_site.push_back(other);  // same slot? checked under its lock
      }
    }
  }
  for (auto& other : same_site) {
    std::shared_ptr<TcpOp> local = op, remote = other;
    std::string message;
    {
      std::scoped_lock lock(op->mu, other->mu);
      if (op->locals.empty()) std::swap(local, remote);
      // A local operation that heard from the remote one's sender runs the
      // same program as that sender: the remote one is a later program's.
      if (local->locals.empty() || !remote->locals.empty() ||
          local->failed || remote->failed || !local->has_desc ||
          !remote->has_desc || local->desc.slot_id == 0 ||
          local->desc.slot_id != remote->desc.slot_id ||
          same_operation(local->desc, remote->desc) ||
          local->heard_from.count(remote->first_sender) ||
          !local->plan || local->process_of_rank.empty() ||
          !local->expects_data_from(remote->first_sender)) {
        continue;
      }
      std::ostringstream os;
      os << "jaxring allreduce (op " << local->key.op_id << ", group "
         << local->key.group << "): the processes run different programs: "
         << "this process calls it with " << local->desc.describe()
         << " but process " << remote->first_sender << " with "
         << remote->desc.describe()
         << ". Every process must run the same program with the same shapes, "
            "dtypes and ops.";
      message = tagged(FailureKind::kMismatch, remote->first_sender, os.str());
      // The remote run's abort must reach its ranks: they run elsewhere.
      remote->process_of_rank = local->process_of_rank;
    }
    fail(local, message, /*tell_peers=*/true);
    fail(remote, message, /*tell_peers=*/true);
  }
}

void Transport::collect_garbage() {
  const auto now = Clock::now();
  frame_created_ops_ = 0;
  for (auto it = ops_.begin(); it != ops_.end();) {
    TcpOp& op = *it->second;
    bool drop, unstarted;
    {
      std::lock_guard<std::mutex> lock(op.mu);
      unstarted = op.process_of_rank.empty();
      // A failed operation stays so that latecomers fail fast with its
      // error; it goes a timeout after its deadline. One no local rank
      // started goes at its deadline.
      const auto grace = std::chrono::duration_cast<Clock::duration>(
          std::chrono::duration<double>(op.timeout_s));
      drop = unstarted ? now > op.deadline : now > op.deadline + grace;
    }
    if (drop) {
      it = ops_.erase(it);
    } else {
      frame_created_ops_ += unstarted;
      ++it;
    }
  }
}

int Transport::listen(const std::string& bind_host, const JobIdentity& identity,
                      std::string* error) {
  std::lock_guard<std::mutex> lock(mu_);
  if (listen_fd_ >= 0) {
    const JobIdentity mine = this->identity();
    if (identity.process != mine.process || identity.processes != mine.processes ||
        identity.secret != mine.secret || identity.job_id != mine.job_id) {
      *error = "the TCP transport already listens for another job identity";
      return -1;
    }
    return port_;
  }
  if (std::string problem = identity_problem(identity); !problem.empty()) {
    *error = problem;
    return -1;
  }
  {
    std::lock_guard<std::mutex> id_lock(identity_mu_);
    identity_ = identity;
  }
  listen_host_ = bind_host;
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* res = nullptr;
  const int rc = ::getaddrinfo(bind_host.empty() ? nullptr : bind_host.c_str(),
                               "0", &hints, &res);
  if (rc != 0) {
    *error = std::string("resolve ") + bind_host + ": " + ::gai_strerror(rc);
    return -1;
  }
  int fd = -1;
  for (addrinfo* ai = res; ai; ai = ai->ai_next) {
    fd = ::socket(ai->ai_family, ai->ai_socktype, ai->ai_protocol);
    if (fd < 0) continue;
    int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(fd, ai->ai_addr, ai->ai_addrlen) == 0 && ::listen(fd, 128) == 0) {
      break;
    }
    *error = std::string("bind/listen on ") + bind_host + ": " + std::strerror(errno);
    ::close(fd);
    fd = -1;
  }
  ::freeaddrinfo(res);
  if (fd < 0) return -1;
  sockaddr_storage ss{};
  socklen_t len = sizeof(ss);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len);
  port_ = ntohs(ss.ss_family == AF_INET6
                    ? reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port
                    : reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
  listen_fd_ = fd;
  std::thread([this, fd] { accept_loop(fd); }).detach();
  return port_;
}

void Transport::accept_loop(int listen_fd) {
  for (;;) {
    const int fd = ::accept(listen_fd, nullptr, nullptr);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      if (errno == EMFILE || errno == ENFILE) {
        // Peers cannot get in until descriptors are free: transport_info
        // says why.
        note_refusal(std::string("this process cannot accept a connection: ") +
                     std::strerror(errno) + " (raise its limit: ulimit -n)",
                     /*connection=*/false);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      continue;
    }
    if (handshaking_.load() >= kMaxHandshakes) {
      // Strangers hold every handshake slot: this one waits for none.
      ::close(fd);
      note_refusal("too many connections in their handshake");
      continue;
    }
    tune_socket(fd);
    ++handshaking_;
    try {
      std::thread([this, fd] { read_loop(fd); }).detach();
    } catch (const std::system_error& e) {
      --handshaking_;
      ::close(fd);
      note_refusal(std::string("this process cannot start a thread: ") + e.what());
    }
  }
}

// Receives the payload of a data frame into dest (a local buffer or a staged
// copy), switching to a scratch buffer if the operation fails meanwhile so
// that a failed rank can complete without waiting for the wire.
ReadResult receive_payload(int fd, TcpOp& op, char* dest, size_t n,
                           double stall_s, bool* released, std::string* error) {
  std::vector<char> scratch;
  while (n > 0) {
    if (!*released && op.failed_flag.load()) {
      std::vector<TcpWorker*> wake;
      {
        std::lock_guard<std::mutex> lock(op.mu);
        --op.writers;
        for (auto& [rank, l] : op.locals) wake.push_back(l.worker);
      }
      *released = true;
      for (TcpWorker* w : wake) w->wake();
    }
    const size_t piece = std::min(n, kRecvSlice);
    char* into = dest;
    if (*released) {
      scratch.resize(piece);
      into = scratch.data();
    }
    const ReadResult r = read_exact(fd, into, piece, false, stall_s, error);
    if (r != ReadResult::kOk) return r;
    dest += piece;
    n -= piece;
  }
  return ReadResult::kOk;
}


// Reads and drops n bytes of a frame nobody wants, a slice at a time: what
// it allocates does not depend on what the frame announces.
ReadResult drain_payload(int fd, int64_t n, double stall_s, std::string* error) {
  char slice[64 * 1024];
  while (n > 0) {
    const size_t piece = static_cast<size_t>(std::min<int64_t>(n, sizeof(slice)));
    const ReadResult r = read_exact(fd, slice, piece, false, stall_s, error);
    if (r != ReadResult::kOk) return r;
    n -= static_cast<int64_t>(piece);
  }
  return ReadResult::kOk;
}

void Transport::read_loop(int fd) {
  std::string error;
  int peer = -1, channel = -1;
  const bool proved = accept_handshake(fd, identity(), after_seconds(kHandshakeTimeoutS),
                                       &peer, &channel, &error);
  --handshaking_;
  if (!proved || !claim_inbound(peer, channel)) {
    // A stranger, another job, or a second connection for a channel already
    // open: it goes quietly, and no process of the job is blamed.
    ::close(fd);
    note_refusal(proved ? "a second connection from process " + std::to_string(peer) +
                              " for channel " + std::to_string(channel)
                        : error);
    return;
  }
  // From here on the connection speaks for process `peer`.
  struct Release {
    Transport* t;
    int peer, channel;
    ~Release() { t->release_inbound(peer, channel); }
  } release{this, peer, channel};
  for (;;) {
    FrameHeader h{};
    ReadResult r = read_exact(fd, reinterpret_cast<char*>(&h), sizeof(h),
                              /*idle_ok=*/true, kConnectTimeoutS, &error);
    if (r == ReadResult::kOk && h.magic != kWireMagic) {
      error = "protocol error: bad frame magic";
      r = ReadResult::kError;
    }
    if (r != ReadResult::kOk) {
      ::close(fd);
      std::this_thread::sleep_for(kLostPeerGrace);
      peer_lost(peer, error);
      return;
    }
    const bool message_frame = h.kind == kAbort || h.kind == kPeerLost;
    if ((!message_frame && h.kind != kData) || h.payload_bytes < 0 ||
        h.payload_bytes > (message_frame ? kMaxMessageBytes : kMaxPayloadBytes)) {
      ::close(fd);
      peer_lost(peer, "protocol error: a frame of unknown kind or size");
      return;
    }
    if (h.kind == kAbort || h.kind == kPeerLost) {
      std::string message(static_cast<size_t>(h.payload_bytes), '\0');
      if (read_exact(fd, message.data(), message.size(), false,
                     kConnectTimeoutS, &error) != ReadResult::kOk) {
        ::close(fd);
        peer_lost(peer, error);
        return;
      }
      // The sender's words are kept as text only: its own tag is dropped,
      // and this process tags the failure from the header's numbers.
      FailureKind ignored_kind;
      int ignored_peer;
      std::string words;
      parse_tag(message, &ignored_kind, &ignored_peer, &words);
      if (words.size() > kMaxKeptMessage) {
        words.resize(kMaxKeptMessage);
        words += "...";
      }
      const int processes = identity().processes;
      const FailureKind kind = h.phase >= 0 && h.phase < kNumFailureKinds
                                   ? static_cast<FailureKind>(h.phase)
                                   : FailureKind::kInternal;
      // The process the sender's failure points at, or else the sender.
      const int points_at =
          h.src_rank >= 0 && h.src_rank < processes ? h.src_rank : peer;
      std::ostringstream os;
      os << words << " [reported by process " << peer << "]";
      if (h.kind == kPeerLost) {
        // Only about another process of the job: a process cannot report
        // itself or this one lost.
        const int lost = h.group >= 0 && h.group < identity().processes
                             ? static_cast<int>(h.group) : -1;
        if (lost >= 0 && lost != peer && lost != me()) {
          peer_lost(lost, os.str(), /*tell_others=*/false);
        }
      } else if (std::shared_ptr<TcpOp> target = op_for_frame(key_of(h))) {
        fail(target, tagged(kind, points_at, os.str()), /*tell_peers=*/false);
      }
      continue;
    }
    if (!plausible_data_header(h)) {
      // Nothing this build sends: a stranger or garbage. The connection
      // goes, quietly: no state is made for it, and no process is blamed.
      ::close(fd);
      return;
    }
    std::shared_ptr<TcpOp> op_ptr = op_for_frame(key_of(h));
    if (!op_ptr) {
      // Too many operations ahead of this process: the sender's fails, and
      // says why, instead of waiting out its timeout.
      std::ostringstream os;
      os << "jaxring allreduce (op " << h.op_id << ", group " << h.group << ", run "
         << h.run_id << "): process " << me() << " holds " << kMaxFrameCreatedOps
         << " operations that peers started and it did not, and refuses more: "
            "the processes do not run the same allreduces";
      send_abort(peer, key_of(h), FailureKind::kResource,
                 tagged(FailureKind::kResource, me(), os.str()));
      r = drain_payload(fd, h.payload_bytes, kConnectTimeoutS, &error);
      if (r != ReadResult::kOk) {
        ::close(fd);
        peer_lost(peer, error);
        return;
      }
      continue;
    }
    TcpOp& o = *op_ptr;
    // A data frame: find where its bytes go.
    std::string mismatch;
    char* dest = nullptr;
    double stall_s;  // read under the lock: a joining rank may set it
    bool discard = false;
    int64_t unit = h.unit;
    {
      std::lock_guard<std::mutex> lock(o.mu);
      stall_s = o.timeout_s;
      const OpDesc theirs = desc_of(h);
      if (o.failed) {
        discard = true;
      } else if (!o.has_desc) {
        // The first word of an operation this process has not reached.
        try {
          ReduceOp unused;
          if (h.elem_type < 0 || h.elem_type > static_cast<int>(ElemType::kU64) ||
              !reduce_op_from_int(h.reduce_op, &unused)) {
            throw std::invalid_argument("unknown element type or reduction");
          }
          o.set_desc(theirs);
          o.first_sender = peer;
        } catch (const std::exception& e) {
          mismatch = tagged(FailureKind::kMismatch, peer,
                            o.name() + ": protocol error: " + e.what());
          discard = true;
        }
      } else if (!same_operation(o.desc, theirs)) {
        std::ostringstream os;
        os << o.name() << ": rank " << h.src_rank << " (process " << peer
           << ") called it with " << theirs.describe()
           << ". Every rank must pass the same shape, dtype and op.";
        mismatch = tagged(FailureKind::kMismatch, peer, os.str());
        discard = true;
      }
      if (!discard) {
        const TieredPlan& plan = *o.plan;
        const bool in_plan =
            h.ring >= 0 && h.ring < o.desc.num_rings && h.dst_rank >= 0 &&
            h.dst_rank < o.desc.world_size && h.phase >= 0 &&
            h.phase < plan.num_phases() && unit >= 0 &&
            unit < plan.num_units(h.ring, h.phase, h.dst_rank) &&
            h.src_rank == plan.prev_rank(h.ring, h.phase, h.dst_rank) &&
            h.phase >= o.inbox(h.dst_rank, h.ring).phase;
        const int64_t esize = plan.elem_bytes();
        const Span span =
            in_plan ? plan.recv_span(h.ring, h.phase, h.dst_rank, unit)
                    : Span{0, -1};
        // Once a local rank has joined, the plan says which process runs
        // each rank: a frame from a rank must come over a connection from
        // that rank's process.
        const bool from_its_process =
            o.process_of_rank.empty() ||
            (h.src_rank < static_cast<int64_t>(o.process_of_rank.size()) &&
             o.process_of_rank[h.src_rank] == peer);
        // Empty units are never sent, and a unit the plan sends once cannot
        // come twice: a second copy would be counted again (or free a staged
        // buffer the worker may be reading). Only a broken peer sends these.
        if (!in_plan || !from_its_process || span.count == 0 ||
            span.count * esize != h.payload_bytes ||
            o.inbox(h.dst_rank, h.ring).received.count({h.phase, unit})) {
          mismatch = tagged(FailureKind::kMismatch, peer,
                            o.name() + ": protocol error: a frame does not fit the plan");
          discard = true;
        } else {
          Inbox& ib = o.inbox(h.dst_rank, h.ring);
          auto local = o.locals.find(h.dst_rank);
          if (local != o.locals.end() && h.phase == ib.phase) {
            dest = static_cast<char*>(local->second.out) + span.offset * esize;
          } else {
            try {
              if (StagingPool::get().in_use() + h.payload_bytes > kMaxStagedFromWire) {
                throw std::bad_alloc();
              }
              Staged staged(static_cast<size_t>(h.payload_bytes));
              staged.from_process = peer;
              dest = staged.data.get();
              ib.staged[{h.phase, unit}] = std::move(staged);
            } catch (const std::bad_alloc&) {
              std::ostringstream os;
              os << o.name() << ": cannot stage " << h.payload_bytes
                 << " more bytes from process " << peer << " (this process "
                 << "holds " << StagingPool::get().in_use() << " bytes of "
                 << "frames for operations it has not reached, at most "
                 << kMaxStagedFromWire << ")";
              mismatch = tagged(FailureKind::kResource, peer, os.str());
              discard = true;
            }
          }
          if (!discard) {
            ib.received.insert({h.phase, unit});
            o.heard_from.insert(peer);
            ++o.writers;
          }
        }
      }
    }
    if (!mismatch.empty()) fail(op_ptr, mismatch, /*tell_peers=*/true);
    bool released = discard;
    if (discard) {
      r = drain_payload(fd, h.payload_bytes, stall_s, &error);
    } else {
      r = receive_payload(fd, o, dest, static_cast<size_t>(h.payload_bytes),
                          stall_s, &released, &error);
    }
    TcpWorker* wake = nullptr;
    {
      std::lock_guard<std::mutex> lock(o.mu);
      if (!released) {
        --o.writers;
        if (r == ReadResult::kOk && !o.failed) {
          Inbox& ib = o.inbox(h.dst_rank, h.ring);
          ib.ready[h.phase].push_back(unit);
          ++ib.arrived[h.phase];
          auto local = o.locals.find(h.dst_rank);
          if (local != o.locals.end()) wake = local->second.worker;
        }
      }
      if (o.failed) {
        for (auto& [rank, l] : o.locals) l.worker->wake();
      }
    }
    if (wake) wake->wake();
    if (r != ReadResult::kOk) {
      ::close(fd);
      peer_lost(peer, error);
      return;
    }
  }
}

void release_send(const OutFrame& f) {
  if (f.abort_of) f.abort_of->aborts_in_flight.fetch_sub(1);
  if (!f.op) return;
  TcpWorker* w = nullptr;
  {
    std::lock_guard<std::mutex> lock(f.op->mu);
    auto it = f.op->locals.find(f.rank);
    if (it != f.op->locals.end()) {
      --it->second.outstanding_sends;
      w = it->second.worker;
    }
  }
  if (w) w->wake();
}

void OutLink::die(const std::string& why) {
  std::deque<OutFrame> dropped;
  {
    std::lock_guard<std::mutex> lock(mu_);
    dead_ = true;
    dropped.swap(queue_);
  }
  Transport::get().peer_lost(process_, why);
  for (const OutFrame& f : dropped) release_send(f);
}

void OutLink::loop() {
  std::string error;
  const int fd = connect_to(address_, kConnectTimeoutS, &error);
  if (fd < 0) {
    die(error);
    return;
  }
  if (!connect_handshake(fd, identity_, process_, channel_,
                         after_seconds(kHandshakeTimeoutS), &error)) {
    ::close(fd);
    die(error);
    return;
  }
  for (;;) {
    OutFrame f;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return !queue_.empty(); });
      f = std::move(queue_.front());
      queue_.pop_front();
    }
    if (f.op && f.op->failed_flag.load()) {  // nobody waits for it any more
      release_send(f);
      continue;
    }
    const char* p = reinterpret_cast<const char*>(&f.header);
    size_t n = sizeof(f.header);
    bool ok = write_all(fd, p, n, f.stall_s, nullptr, &error);
    if (ok) {
      const char* data = f.op ? f.data : f.message.data();
      size_t left = static_cast<size_t>(f.header.payload_bytes);
      // If the operation fails mid-frame, its rank must be free to complete:
      // finish the frame (the stream must stay whole) from a private copy.
      std::vector<char> copy;
      bool released = !f.op;
      auto on_slice = [&] {
        if (!released && f.op->failed_flag.load()) {
          copy.assign(data, data + left);
          data = copy.data();
          released = true;
          release_send(f);
        }
      };
      ok = write_all(fd, data, left, f.stall_s, on_slice, &error);
      if (!released || !f.op) release_send(f);
    } else {
      release_send(f);
    }
    if (!ok) {
      ::close(fd);
      die(error);
      return;
    }
  }
}

// ---- the worker --------------------------------------------------------------

void TcpWorker::loop() {
  std::list<Task> active;
  for (;;) {
    const uint64_t seen = queue_.collect(active);
    bool progressed = false;
    for (auto it = active.begin(); it != active.end();) {
      bool finished = false;
      progressed |= advance(*it, &finished);
      it = finished ? active.erase(it) : std::next(it);
    }
    // The deadline poll bounds the sleep so timeouts are noticed.
    if (!progressed && !active.empty()) {
      queue_.wait_until(seen, Clock::now() + kDeadlinePoll);
    }
  }
}

// Hands unit u of (ring, phase) (data at `data`, `bytes` long) to the next
// rank: over TCP, or into its buffer when it lives in this process (staged
// if it has not joined or not reached the phase yet).
// Requires op.mu; returns an error message if the next rank is unreachable.
std::string send_unit(const std::shared_ptr<TcpOp>& op_ptr, int rank, int ring,
                      int phase, int64_t u, const char* data, int64_t bytes,
                      std::vector<TcpWorker*>* wake) {
  TcpOp& op = *op_ptr;
  const TieredPlan& plan = *op.plan;
  const int next = plan.next_rank(ring, phase, rank);
  const int proc = op.process_of_rank[next];
  Transport& tr = Transport::get();
  if (op.failed) return std::string();  // a failed rank must not be touched
  if (proc == tr.me()) {
    Inbox& ib = op.inbox(next, ring);
    auto local = op.locals.find(next);
    if (local != op.locals.end() && ib.phase == phase) {
      const Span span = plan.recv_span(ring, phase, next, u);
      std::memcpy(static_cast<char*>(local->second.out) +
                      span.offset * plan.elem_bytes(),
                  data, static_cast<size_t>(bytes));
    } else {
      Staged& st = ib.staged[{phase, u}];
      st = Staged(static_cast<size_t>(bytes));
      st.from_process = tr.me();
      std::memcpy(st.data.get(), data, static_cast<size_t>(bytes));
    }
    ib.received.insert({phase, u});
    if (local != op.locals.end()) wake->push_back(local->second.worker);
    ib.ready[phase].push_back(u);
    ++ib.arrived[phase];
    return std::string();
  }
  OutFrame f;
  FrameHeader& h = f.header;
  h.magic = kWireMagic;
  h.kind = kData;
  h.run_id = op.key.run_id;
  h.op_id = op.key.op_id;
  h.group = op.key.group;
  h.ring = ring;
  h.dst_rank = next;
  h.src_rank = rank;
  h.elem_type = static_cast<int32_t>(op.desc.type);
  h.reduce_op = static_cast<int32_t>(op.desc.op);
  h.world_size = op.desc.world_size;
  h.num_rings = op.desc.num_rings;
  h.phase = phase;
  h.count = op.desc.count;
  h.chunk_bytes = op.desc.chunk_bytes;
  h.topology = pack_topology(op.desc.topology);
  h.slot_id = op.desc.slot_id;
  h.unit = u;
  h.payload_bytes = bytes;
  f.data = data;
  f.op = op_ptr;
  f.rank = rank;
  f.stall_s = op.timeout_s;
  ++op.locals[rank].outstanding_sends;
  if (!tr.send(proc, ring, std::move(f))) {
    --op.locals[rank].outstanding_sends;
    std::ostringstream os;
    os << op.name() << ": cannot send to rank " << next << " (process " << proc
       << "): " << tr.dead_reason(proc);
    return tagged(FailureKind::kPeerLost, proc, os.str());
  }
  return std::string();
}

const char* phase_name(PhaseKind kind) {
  switch (kind) {
    case PhaseKind::kReduceScatter: return "reduce-scatter";
    case PhaseKind::kAllreduce: return "allreduce";
    case PhaseKind::kAllGather: return "all-gather";
  }
  return "?";
}

bool TcpWorker::advance(Task& task, bool* finished) {
  TcpOp& op = *task.op;
  std::vector<TcpWorker*> wake;
  std::string error;
  bool progressed = false;
  std::unique_lock<std::mutex> lock(op.mu);
  LocalRank& me = op.locals[task.rank];
  const TieredPlan& plan = *op.plan;
  const int phases = plan.num_phases();
  const int64_t esize = plan.elem_bytes();

  auto complete = [&](const std::optional<std::string>& result) {
    if (!result && timeline_enabled()) {
      timeline_record({device_, op.key.run_id, op.key.op_id,
                       op.desc.count * esize, op.desc.num_rings, me.joined_ns,
                       timeline_now_ns()});
    }
    const bool last = ++op.completed_locals == op.expected_locals;
    lock.unlock();
    for (TcpWorker* w : wake) w->wake();
    if (last) Transport::get().forget(task.op);
    task.done(result);
    *finished = true;
    return true;
  };

  if (op.failed) {
    // Complete once no I/O thread still touches this rank's buffers.
    if (op.writers > 0 || me.outstanding_sends > 0) return false;
    if (op.aborts_in_flight.load() > 0 &&
        Clock::now() < op.failed_at + kAbortFlush) {
      return false;
    }
    return complete(op.error);
  }

  // This rank's own contribution to the reduce steps of phase j of ring r,
  // for the element at `offset`: its input in the first phase, the copy of
  // the previous phase's result after that.
  auto own = [&](int r, int j, int64_t offset) -> const char* {
    if (j == 0) return static_cast<const char*>(me.in) + offset * esize;
    return me.own[r].get() + (offset - me.own_offset[r]) * esize;
  };

  // Unit u of (ring r, phase j) received: reduce it into (or store it as)
  // this rank's result, then hand the chunk on to the next rank as unit u+1
  // unless it was the phase's last step.
  auto consume = [&](int r, int j, int64_t u) {
    const int steps = plan.phase(j).num_steps;
    const Span span = plan.recv_span(r, j, task.rank, u);
    Inbox& ib = op.inbox(task.rank, r);
    if (span.count > 0) {
      char* dst = static_cast<char*>(me.out) + span.offset * esize;
      auto staged = ib.staged.find({j, u});
      const char* src =
          staged != ib.staged.end() ? staged->second.data.get() : dst;
      lock.unlock();
      if (plan.is_reduce_unit(j, u)) {
        // Same operand order as the in-process transport: the neighbour's
        // partial first, so both transports give the same bits.
        reduce(op.desc.type, op.desc.op, dst, src, own(r, j, span.offset),
               span.count);
      } else if (src != dst) {
        std::memcpy(dst, src, static_cast<size_t>(span.count * esize));
      }
      lock.lock();
      if (staged != ib.staged.end()) ib.staged.erase(staged);
      // The operation may have failed while the lock was dropped; then the
      // other local ranks may have completed, and nothing more is sent.
      if (op.failed) return;
    }
    if (u % steps != steps - 1) {
      const Span fwd = plan.send_span(r, j, task.rank, u + 1);
      if (fwd.count > 0) {
        error = send_unit(task.op, task.rank, r, j, u + 1,
                          static_cast<const char*>(me.out) + fwd.offset * esize,
                          fwd.count * esize, &wake);
      }
    }
  };

  // Moves ring r to phase j: takes a copy of the shard as this rank's own
  // contribution (a reduce phase after the first), opens the phase to
  // direct writes, and sends the first unit of every chunk.
  auto enter_phase = [&](int r, int j) {
    task.phase[r] = j;
    if (j == phases) return;
    const Phase& ph = plan.phase(j);
    Inbox& ib = op.inbox(task.rank, r);
    if (j > 0 && ph.kind != PhaseKind::kAllGather) {
      // Frames of phase j are staged until ib.phase says otherwise, so the
      // shard can be copied without the lock.
      const Span s = plan.shard(r, j, task.rank);
      char* to = me.own[r].get() + (s.offset - me.own_offset[r]) * esize;
      const char* from = static_cast<const char*>(me.out) + s.offset * esize;
      lock.unlock();
      std::memcpy(to, from, static_cast<size_t>(s.count * esize));
      lock.lock();
      if (op.failed) return;
    }
    ib.phase = j;
    const int64_t units = plan.num_units(r, j, task.rank);
    for (int64_t u = 0; u < units && error.empty() && !op.failed; ++u) {
      if (u % ph.num_steps == 0) {
        const Span s = plan.send_span(r, j, task.rank, u);
        if (s.count > 0) {
          const char* data =
              ph.kind == PhaseKind::kAllGather
                  ? static_cast<const char*>(me.out) + s.offset * esize
                  : own(r, j, s.offset);
          error = send_unit(task.op, task.rank, r, j, u, data, s.count * esize,
                            &wake);
        }
      }
      // Empty units carry nothing: consume them now, nobody sends them.
      if (plan.recv_span(r, j, task.rank, u).count > 0) {
        ++task.remaining[r];
      } else {
        consume(r, j, u);
      }
    }
  };

  if (!task.started) {
    task.started = true;
    progressed = true;
    if (phases > 1) {
      // Phase 1's shard holds the shards of all later phases.
      me.own.resize(plan.num_rings());
      me.own_offset.resize(plan.num_rings());
      for (int r = 0; r < plan.num_rings(); ++r) {
        const Span s = plan.shard(r, 1, task.rank);
        me.own[r].reset(new char[std::max<int64_t>(1, s.count * esize)]);
        me.own_offset[r] = s.offset;
      }
    }
    for (int r = 0; r < plan.num_rings() && error.empty() && !op.failed; ++r) {
      enter_phase(r, 0);
    }
  }

  bool all_done = true;
  for (int r = 0; r < plan.num_rings() && error.empty() && !op.failed; ++r) {
    Inbox& ib = op.inbox(task.rank, r);
    while (task.phase[r] < phases && error.empty() && !op.failed) {
      const int j = task.phase[r];
      std::deque<int64_t>& ready = ib.ready[j];
      while (!ready.empty() && error.empty() && !op.failed) {
        const int64_t u = ready.front();
        ready.pop_front();
        consume(r, j, u);
        --task.remaining[r];
        progressed = true;
      }
      if (task.remaining[r] > 0) break;
      enter_phase(r, j + 1);
      progressed = true;
    }
    if (task.phase[r] < phases) all_done = false;
  }
  // Fails the operation for every rank; this task completes on a later
  // pass, once no I/O thread touches its buffers.
  auto fail_all = [&](const std::string& why) {
    lock.unlock();
    for (TcpWorker* w : wake) w->wake();
    Transport::get().fail(task.op, why, /*tell_peers=*/true);
    return true;
  };
  if (!error.empty()) return fail_all(error);
  if (op.failed) return true;  // completes through the failure, next pass
  if (all_done && me.outstanding_sends == 0) return complete(std::nullopt);

  const auto now = Clock::now();
  if (progressed) task.last_progress = now;
  if (!progressed && now > task.last_progress + kMismatchProbeAfter &&
      now > task.next_probe && now <= op.deadline) {
    // Waiting with nothing to do: is a peer at this call site in another
    // program? (It fails this operation if so; the next pass completes.)
    task.next_probe = now + kMismatchProbeAfter;
    lock.unlock();
    for (TcpWorker* w : wake) w->wake();
    Transport::get().check_programs_agree(task.op);
    return false;
  }
  if (!progressed && Clock::now() > op.deadline) {
    std::ostringstream os;
    os << op.name() << " timed out after " << op.timeout_s << " s on rank "
       << task.rank << ": ";
    const char* sep = "";
    std::set<int> waited_for;
    for (int r = 0; r < plan.num_rings(); ++r) {
      const int j = task.phase[r];
      if (j >= phases) continue;
      const Phase& ph = plan.phase(j);
      const int prev = plan.prev_rank(r, j, task.rank);
      Inbox& ib = op.inbox(task.rank, r);
      os << sep << "ring " << r;
      if (phases > 1) {
        os << " (" << phase_name(ph.kind) << " along tier " << ph.tier << ")";
      }
      waited_for.insert(op.process_of_rank[prev]);
      os << " waits for rank " << prev << " (process "
         << op.process_of_rank[prev] << "): " << ib.arrived[j] << " of "
         << ib.arrived[j] + task.remaining[r] << " chunks arrived";
      sep = "; ";
    }
    if (all_done) {
      os << me.outstanding_sends << " frame(s) to the next rank not yet sent";
    }
    os << ". Every process must run the same allreduces; a peer that stopped "
          "responding or took a different branch never sends.";
    // Which peer is stuck is known only when every ring waits for the same.
    const int peer = waited_for.size() == 1 ? *waited_for.begin() : -1;
    return fail_all(tagged(FailureKind::kTimeout, peer, os.str()));
  }
  lock.unlock();
  for (TcpWorker* w : wake) w->wake();
  return progressed;
}

}  // namespace

int tcp_listen(const std::string& bind_host, const JobIdentity& identity,
               std::string* error) {
  return Transport::get().listen(bind_host, identity, error);
}

bool tcp_set_peers(const std::vector<std::string>& addresses, std::string* error) {
  return Transport::get().set_peers(addresses, error);
}

TcpTransportInfo tcp_transport_info() { return Transport::get().info(); }

TcpTransportInfo Transport::info() {
  TcpTransportInfo i;
  {
    std::lock_guard<std::mutex> lock(mu_);
    i.listening = listen_fd_ >= 0;
    i.host = listen_host_;
    i.port = port_;
    i.pending_ops = static_cast<int64_t>(ops_.size());
  }
  const JobIdentity id = identity();
  i.process = id.process;
  i.processes = id.processes;
  i.job_id = id.job_id;
  i.auth_library = tcp_auth_library();
  i.refused_connections = refused_.load();
  std::lock_guard<std::mutex> lock(links_mu_);
  i.inbound.assign(inbound_.begin(), inbound_.end());
  for (const auto& [where, link] : links_) i.outbound.push_back(where);
  for (const auto& [p, why] : dead_) i.lost_processes.push_back(p);
  i.last_refusal = last_refusal_;
  return i;
}

int tcp_process_index() { return Transport::get().me(); }

int64_t tcp_pending_ops() { return Transport::get().pending(); }

// A frame staged before any local rank joined that came from a process
// other than the one running its sender rank (empty if none). Requires
// op.mu held and op.process_of_rank set.
std::string misrouted_staged_frame(const TcpOp& op) {
  if (!op.has_desc) return "";
  const TieredPlan& plan = *op.plan;
  for (const auto& [where, ib] : op.inboxes) {
    const auto& [dst, ring] = where;
    for (const auto& [phase_unit, st] : ib.staged) {
      const int src = plan.prev_rank(ring, phase_unit.first, dst);
      const int runs_on = op.process_of_rank[src];
      if (st.from_process != runs_on) {
        std::ostringstream os;
        os << op.name() << ": protocol error: a frame from rank " << src
           << " came from process " << st.from_process << ", but rank " << src
           << " runs on process " << runs_on;
        return os.str();
      }
    }
  }
  return "";
}

void tcp_allreduce(const OpKey& key, const OpDesc& desc, int rank, int device,
                   const std::vector<int>& process_of_rank, const void* in,
                   void* out, double timeout_s, Completion done) {
  Transport& tr = Transport::get();
  const int me = tr.me();
  if (me < 0) {
    done(tagged(FailureKind::kInvalid, -1,
                op_name(key, desc) +
                    ": the TCP transport is not set up (jaxring sets it up when it "
                    "lowers a cross-process allreduce after "
                    "jax.distributed.initialize)"));
    return;
  }
  if (static_cast<int>(process_of_rank.size()) != desc.world_size) {
    done(tagged(FailureKind::kInvalid, -1,
                op_name(key, desc) + ": the process table does not match the world size"));
    return;
  }
  for (int p : process_of_rank) {
    const std::string dead = tr.dead_reason(p);
    if (!dead.empty()) {
      done(tagged(FailureKind::kPeerLost, p, op_name(key, desc) + ": " + dead));
      return;
    }
  }
  TcpWorker* worker = tr.worker(device);  // before op->mu: see lock order
  std::shared_ptr<TcpOp> op = tr.op(key);
  std::string error;     // this call cannot join; others may still run
  bool tell = false;     // and the operation fails for every rank
  {
    std::lock_guard<std::mutex> lock(op->mu);
    if (op->process_of_rank.empty()) {
      // The first local rank: now the peers to tell about a failure are known.
      op->process_of_rank = process_of_rank;
      op->expected_locals = static_cast<int>(
          std::count(process_of_rank.begin(), process_of_rank.end(), me));
      op->timeout_s = timeout_s;
      op->deadline = after_seconds(timeout_s);
    }
    tr.note_timeout(timeout_s);
    if (op->failed) {
      error = op->error;
    } else if (op->has_desc && !same_operation(op->desc, desc)) {
      std::ostringstream os;
      os << op_name(key, desc) << ": rank " << rank
         << " (process " << me << ") called it with " << desc.describe()
         << " but rank(s) elsewhere with " << op->desc.describe()
         << ". Every rank must pass the same shape, dtype and op.";
      error = tagged(FailureKind::kMismatch, -1, os.str());
      tell = true;
    } else if (op->process_of_rank != process_of_rank) {
      error = tagged(FailureKind::kMismatch, -1,
                     op_name(key, desc) +
                         ": ranks of this process disagree on where the ranks run");
      tell = true;
    } else if (std::string forged = misrouted_staged_frame(*op); !forged.empty()) {
      error = tagged(FailureKind::kMismatch, -1, forged);
      tell = true;
    } else if (op->locals.count(rank)) {
      std::ostringstream os;
      os << op_name(key, desc) << ": rank " << rank
         << " joined twice (two devices computed the same rank)";
      error = tagged(FailureKind::kInternal, -1, os.str());
      tell = true;
    }
    if (error.empty() && !op->has_desc) {
      try {
        op->set_desc(desc);
      } catch (const std::exception& e) {
        error = tagged(FailureKind::kInvalid, -1, op_name(key, desc) + ": " + e.what());
        tell = true;  // the peers would otherwise wait for this rank
      }
    }
    if (error.empty()) {
      advise_huge_pages(out, desc.count * elem_bytes(desc.type));
      LocalRank& l = op->locals[rank];
      l.in = in;
      l.out = out;
      l.device = device;
      l.worker = worker;
      l.joined_ns = timeline_now_ns();
      // Units that arrived before this rank joined stay staged; the worker
      // consumes them from there.
      for (int r = 0; r < desc.num_rings; ++r) op->inbox(rank, r);
    }
  }
  if (!error.empty()) {
    // Local ranks that did join complete through the failure; this call was
    // never registered, so it completes here.
    if (tell) tr.fail(op, error, /*tell_peers=*/true);
    done(error);
    return;
  }
  Task task{op, rank, std::move(done), std::vector<int>(desc.num_rings, 0),
            std::vector<int64_t>(desc.num_rings, 0)};
  worker->submit(std::move(task));
  // A peer lost between the check above and the join would not have seen
  // this op among those to fail.
  for (int p : process_of_rank) {
    const std::string dead = tr.dead_reason(p);
    if (!dead.empty()) {
      tr.fail(op, tagged(FailureKind::kPeerLost, p, op_name(key, desc) + ": " + dead),
              /*tell_peers=*/true);
      break;
    }
  }
}

}  // namespace jaxring
