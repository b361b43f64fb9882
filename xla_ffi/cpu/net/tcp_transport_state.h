// The TCP transport's process-wide state (tcp_transport.h says what the
// transport does and why): the operations this process holds, the
// connections to the other processes, and how a failure spreads. Its
// methods live by concern in tcp_transport.cc (operations and the entry
// point), tcp_failure.cc (failures and lost peers) and tcp_inbound.cc (the
// listener and the frames that arrive). The ranks themselves run on the
// plan executor (plan_executor.h), for which this is the OpHost.
#pragma once

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "failure.h"
#include "cpu/net/socket_io.h"
#include "cpu/plan/plan_op.h"
#include "cpu/net/tcp_handshake.h"
#include "cpu/net/tcp_out_link.h"
#include "cpu/net/tcp_transport.h"

namespace jaxring {

// How long an accepted connection has to prove itself, and how many may be
// at it at once (a job needs at most processes x rings connections, opened
// once; strangers must not hold threads for longer, or more of them).
constexpr int kMaxHandshakes = 64;
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
// Messages (aborts, peer-lost notices) held until set_peers gives the
// addresses: at most this many, beyond which they are dropped (the
// operations still fail here; their peers then wait out their timeouts).
constexpr size_t kMaxEarlyMessages = 256;

class TcpTransport final : public OpHost {
  // A message to send once the addresses are known (see send()).
  struct EarlyMessage {
    int process, channel;
    OutFrame frame;
  };

 public:
  static TcpTransport& get() {
    // Leaked on purpose: threads may use it during interpreter shutdown.
    static TcpTransport* t = new TcpTransport();
    return *t;
  }

  // Opens the listener; from then on a connection is let in only after it
  // proved `identity`'s job (tcp_handshake.h), and its shared-memory offer
  // is taken when use_shm.
  int listen(const std::string& bind_host, const JobIdentity& identity,
             bool use_shm, std::string* error);
  // Where every process listens, and which processes run on this host
  // (their connections are offered a shared-memory ring when use_shm);
  // false (with *error) if listen() has not run or the count differs from
  // the job's.
  bool set_peers(const std::vector<std::string>& addresses,
                 const std::vector<int>& same_host, std::string* error) {
    const JobIdentity id = identity();
    if (id.processes == 0) {
      *error = "tcp_set_peers before tcp_listen";
      return false;
    }
    if (static_cast<int>(addresses.size()) != id.processes) {
      *error = "got " + std::to_string(addresses.size()) +
               " addresses for a job of " + std::to_string(id.processes) +
               " processes";
      return false;
    }
    std::vector<EarlyMessage> early;
    {
      std::lock_guard<std::mutex> lock(links_mu_);
      addresses_ = addresses;
      same_host_.clear();
      for (int p : same_host) {
        if (p >= 0 && p < id.processes && p != id.process) same_host_.insert(p);
      }
      me_.store(id.process);
      early.swap(early_messages_);
    }
    send_early(std::move(early));
    return true;
  }
  bool use_shm() const { return use_shm_.load(); }
  // A shared-memory ring could not be made or mapped here: said once per
  // process (on stderr), kept for transport_info; that link uses TCP.
  void note_shm_unavailable(const std::string& why);
  // An accepted connection's ring is mapped (or no longer is).
  void note_inbound_ring(int p, int channel, bool mapped) {
    std::lock_guard<std::mutex> lock(links_mu_);
    if (mapped) {
      inbound_rings_.insert({p, channel});
    } else {
      inbound_rings_.erase({p, channel});
    }
  }
  JobIdentity identity() {
    std::lock_guard<std::mutex> lock(identity_mu_);
    return identity_;
  }
  TcpTransportInfo info();
  int me() const { return me_.load(); }

  // The operation for key, created if new.
  std::shared_ptr<PlanOp> op(const OpKey& key);
  // The operation a frame is for: created if new, unless frames already
  // made kMaxFrameCreatedOps operations that no local rank started (then
  // nullptr). A new one expires after the longest timeout local calls used
  // so far, if no local rank starts it.
  std::shared_ptr<PlanOp> op_for_frame(const OpKey& key);
  // A local call's timeout: frame-created operations live as long as the
  // longest one seen (kDefaultTimeoutS before any).
  void note_timeout(double timeout_s) {
    double seen = frame_state_timeout_s_.load();
    while (timeout_s > seen &&
           !frame_state_timeout_s_.compare_exchange_weak(seen, timeout_s)) {
    }
  }
  // OpHost.
  int process() const override { return me(); }
  std::string send_remote(const std::shared_ptr<PlanOp>& op, int rank, int ring,
                          int phase, int64_t u, const char* data,
                          int64_t bytes) override;
  void fail(const std::shared_ptr<PlanOp>& op,
            const std::string& why) override {
    fail(op, why, /*tell_peers=*/true);
  }
  void forget(const std::shared_ptr<PlanOp>& op) override {
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
  // Before set_peers, a message (an abort, a peer-lost notice: a peer may
  // connect, and its frame fail, as soon as it knows this process's port)
  // is held until the addresses are known.
  // A data frame may be written on the calling thread (OutLink::send_data):
  // *written_here then says so.
  bool send(int p, int channel, OutFrame f, bool* written_here = nullptr);
  // set_peers: sends the held messages.
  void send_early(std::vector<EarlyMessage> early);

  // Process p cannot be reached: every operation that needs it fails, and
  // (tell_others) every other process hears so, including those that never
  // talk to p directly.
  void peer_lost(int p, const std::string& why, bool tell_others = true);
  // Fails op and any operation of the same slot (OpDesc::slot_id) and group
  // in another run or under another op id whose description differs while
  // exactly one of the two has ranks in this process, and the local one never
  // heard from the process that sent the other although its plan has that
  // process send data here: the processes compiled different programs. Run by a
  // rank that has waited kMismatchProbeAfter without progress.
  void check_programs_agree(const std::shared_ptr<PlanOp>& op) override;
  // Fails op and tells every other process of its group. Requires op.mu not
  // held. Returns whether this call failed it (false: it already was).
  bool fail(const std::shared_ptr<PlanOp>& op, const std::string& why,
            bool tell_peers);
  // Tells process p that the operation `key` failed here, for an operation
  // this process holds no state for.
  void send_abort(int p, const OpKey& key, FailureKind kind,
                  const std::string& why) {
    OutFrame f;
    f.header.magic = kWireMagic;
    f.header.kind = kAbort;
    f.header.run_id = key.run_id;
    f.header.op_id = key.op_id;
    f.header.group = key.group;
    f.header.phase = static_cast<int32_t>(kind);
    f.header.src_rank = identity().process;  // me() is -1 until set_peers
    f.header.payload_bytes = static_cast<int64_t>(why.size());
    f.message = why;
    send(p, 0, std::move(f));
  }

 private:
  void accept_loop(int listen_fd);

  // tcp_inbound.cc: one accepted connection, frame by frame.
  struct Inbound;
  struct Landing;
  enum class Next { kContinue, kLost, kQuiet };  // after a frame
  void read_loop(int fd);
  bool admit(Inbound& in);       // the handshake; false: closed quietly
  bool take_offer(Inbound& in);  // the shared-memory offer; same
  static bool frame_fits(const Inbound& in, const FrameHeader& h);
  ReadResult skip_payload(Inbound& in, const FrameHeader& h, double stall_s);
  Next on_message_frame(Inbound& in, const FrameHeader& h);
  Next on_data_frame(Inbound& in, const FrameHeader& h);
  Landing land(const Inbound& in, const FrameHeader& h, PlanOp& o);
  // Under o.mu: the frame names the operation this process knows (or
  // gives it its description), and a unit its plan expects from there.
  static bool agrees(const Inbound& in, const FrameHeader& h, PlanOp& o,
                     Landing* at);
  static bool fits_plan(const Inbound& in, const FrameHeader& h, PlanOp& o,
                        Span* span, Landing* at);
  bool stage(const Inbound& in, const FrameHeader& h, PlanOp& o, Inbox& ib,
             Landing* at);
  ReadResult take_from_ring(Inbound& in, const FrameHeader& h,
                            const Landing& at);
  void arrived(const FrameHeader& h, PlanOp& o, const Landing& at, bool ok,
               bool released);
  void collect_garbage();  // requires mu_

  // Lock order: mu_ may be held while taking an operation's mu (garbage
  // collection); an operation's mu may be held while taking links_mu_
  // (sending). Nothing takes mu_ while holding an operation's mu.
  // identity_mu_ is taken last, under any of them.
  std::mutex mu_;  // ops_, the listener and identity_
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
  std::map<OpKey, std::shared_ptr<PlanOp>> ops_;
  // Operations in ops_ that no local rank joined (counted by
  // collect_garbage), and how long such an operation may wait.
  int frame_created_ops_ = 0;
  std::atomic<double> frame_state_timeout_s_{0};
  std::mutex links_mu_;  // addresses_, links_, dead_, inbound_, last_refusal_
  std::atomic<int> me_{-1};
  std::vector<std::string> addresses_;
  std::atomic<bool> use_shm_{false};
  std::set<int> same_host_;                      // under links_mu_
  std::set<std::pair<int, int>> inbound_rings_;  // under links_mu_
  std::vector<EarlyMessage> early_messages_;     // under links_mu_
  std::string shm_unavailable_;  // under links_mu_: the first reason
  std::map<std::pair<int, int>, std::unique_ptr<OutLink>> links_;
  std::map<int, std::string> dead_;
};

}  // namespace jaxring
