#include "cpu/net/tcp_transport.h"

#include <algorithm>
#include <cstdio>
#include <sstream>
#include <system_error>
#include <utility>

#include "failure.h"
#include "cpu/plan/plan_executor.h"
#include "cpu/net/tcp_transport_state.h"

namespace jaxring {

std::shared_ptr<PlanOp> TcpTransport::op(const OpKey& key) {
  std::lock_guard<std::mutex> lock(mu_);
  collect_garbage();
  auto& slot = ops_[key];
  if (!slot) slot = std::make_shared<PlanOp>(key, this);
  return slot;
}

std::shared_ptr<PlanOp> TcpTransport::op_for_frame(const OpKey& key) {
  std::lock_guard<std::mutex> lock(mu_);
  collect_garbage();
  auto it = ops_.find(key);
  if (it != ops_.end()) return it->second;
  if (frame_created_ops_ >= kMaxFrameCreatedOps) return nullptr;
  auto op = std::make_shared<PlanOp>(key, this);
  const double seen = frame_state_timeout_s_.load();
  const double t = seen > 0 ? seen : kDefaultTimeoutS;
  op->timeout_s = t;
  op->deadline = after_seconds(t);
  ops_[key] = op;
  ++frame_created_ops_;
  return op;
}

void TcpTransport::collect_garbage() {
  const auto now = Clock::now();
  frame_created_ops_ = 0;
  for (auto it = ops_.begin(); it != ops_.end();) {
    PlanOp& op = *it->second;
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

bool TcpTransport::send(int p, int channel, OutFrame f, bool* written_here) {
  OutLink* link;
  {
    std::lock_guard<std::mutex> lock(links_mu_);
    if (addresses_.empty() && !f.op) {
      const JobIdentity id = identity();
      if (dead_.count(p) || p < 0 || p >= id.processes || p == id.process ||
          early_messages_.size() >= kMaxEarlyMessages) {
        return false;
      }
      early_messages_.push_back({p, channel, std::move(f)});
      return true;
    }
    if (dead_.count(p) || p < 0 || p >= static_cast<int>(addresses_.size())) {
      return false;
    }
    auto& l = links_[{p, channel}];
    if (!l && handshakes_closed()) {  // exiting: no new connections
      links_.erase({p, channel});
      return false;
    }
    if (!l) {
      // A link opened to carry a notice (an abort, a lost peer) offers no
      // shared-memory ring: this process is failing and may be killed
      // before the peer maps the ring, whose name would then outlive the
      // job in /dev/shm. Notices are small; TCP carries them.
      const bool offer_shm =
          use_shm() && same_host_.count(p) > 0 && f.header.kind == kData;
      try {
        l.reset(new OutLink(
            p, channel, addresses_[p], identity(), offer_shm,
            [this, p](const std::string& why) { peer_lost(p, why); },
            [this](const std::string& why) { note_shm_unavailable(why); }));
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
  if (!written_here) return link->enqueue(std::move(f));
  const OutLink::Sent sent = link->send_data(std::move(f));
  *written_here = sent == OutLink::Sent::kWritten;
  return sent != OutLink::Sent::kDead;
}

void TcpTransport::send_early(std::vector<EarlyMessage> early) {
  for (EarlyMessage& m : early) {
    std::shared_ptr<PlanOp> abort_of = m.frame.abort_of;
    if (!send(m.process, m.channel, std::move(m.frame)) && abort_of) {
      abort_of->aborts_in_flight.fetch_sub(1);
    }
  }
}

// A data frame for unit u, to the process that runs rank's next rank.
std::string TcpTransport::send_remote(const std::shared_ptr<PlanOp>& op_ptr,
                                      int rank, int ring, int phase, int64_t u,
                                      const char* data, int64_t bytes) {
  PlanOp& op = *op_ptr;
  const int next = op.plan->next_rank(ring, phase, rank);
  const int proc = op.process_of_rank[next];
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
  h.algorithm = static_cast<int32_t>(op.desc.algorithm);
  h.slot_id = op.desc.slot_id;
  h.shape_digest = op.desc.shape_digest;
  h.unit = u;
  h.payload_bytes = bytes;
  f.data = data;
  f.op = op_ptr;
  f.rank = rank;
  f.stall_s = op.timeout_s;
  {
    std::lock_guard<std::mutex> lock(op.mu);
    ++op.locals[rank].outstanding_sends;
  }
  bool written_here = false;
  const bool sent = send(proc, ring, std::move(f), &written_here);
  if (!sent || written_here) {
    std::lock_guard<std::mutex> lock(op.mu);
    --op.locals[rank].outstanding_sends;
  }
  if (!sent) {
    std::ostringstream os;
    os << op.name() << ": cannot send to rank " << next << " (process " << proc
       << "): " << dead_reason(proc);
    return tagged(FailureKind::kPeerLost, proc, os.str());
  }
  return std::string();
}

int tcp_listen(const std::string& bind_host, const JobIdentity& identity,
               bool use_shm, std::string* error) {
  return TcpTransport::get().listen(bind_host, identity, use_shm, error);
}

bool tcp_set_peers(const std::vector<std::string>& addresses,
                   const std::vector<int>& same_host, std::string* error) {
  return TcpTransport::get().set_peers(addresses, same_host, error);
}

void TcpTransport::note_shm_unavailable(const std::string& why) {
  {
    std::lock_guard<std::mutex> lock(links_mu_);
    if (!shm_unavailable_.empty()) return;
    shm_unavailable_ = why;
  }
  std::fprintf(stderr,
               "jaxring: process %d uses TCP instead of shared memory with a "
               "process on its host: %s\n",
               identity().process, why.c_str());
}

TcpTransportInfo tcp_transport_info() { return TcpTransport::get().info(); }

TcpTransportInfo TcpTransport::info() {
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
  for (const auto& [where, link] : links_) {
    i.outbound.push_back(where);
    if (link->shared_memory()) i.shm_outbound.push_back(where);
    i.data_frames_by_device_thread += link->frames_by_caller();
    i.data_frames_by_sender_thread += link->frames_by_link_thread();
    i.data_frames_finished_by_sender_thread +=
        link->frames_finished_for_caller();
  }
  i.shm_inbound.assign(inbound_rings_.begin(), inbound_rings_.end());
  i.shm_unavailable = shm_unavailable_;
  i.same_host.assign(same_host_.begin(), same_host_.end());
  i.use_shm = use_shm();
  for (const auto& [p, why] : dead_) i.lost_processes.push_back(p);
  i.last_refusal = last_refusal_;
  return i;
}

int64_t tcp_pending_ops() { return TcpTransport::get().pending(); }

void tcp_allreduce(const OpKey& key, const OpDesc& desc, int rank, int device,
                   const std::vector<int>& process_of_rank, const void* in,
                   void* out, double timeout_s, Completion done) {
  TcpTransport& tr = TcpTransport::get();
  const int me = tr.me();
  if (me < 0) {
    done(tagged(
        FailureKind::kInvalid, -1,
        op_name(key, desc) +
            ": the TCP transport is not set up (jaxring sets it up when it "
            "lowers a cross-process allreduce after "
            "jax.distributed.initialize)"));
    return;
  }
  if (static_cast<int>(process_of_rank.size()) != desc.world_size) {
    done(tagged(FailureKind::kInvalid, -1,
                op_name(key, desc) +
                    ": the process table does not match the world size"));
    return;
  }
  for (int p : process_of_rank) {
    const std::string dead = tr.dead_reason(p);
    if (!dead.empty()) {
      done(tagged(FailureKind::kPeerLost, p, op_name(key, desc) + ": " + dead));
      return;
    }
  }
  std::shared_ptr<PlanOp> op = tr.op(key);
  std::string error;  // this call cannot join; others may still run
  bool tell = false;  // and the operation fails for every rank
  {
    std::lock_guard<std::mutex> lock(op->mu);
    tr.note_timeout(timeout_s);
    error = join_rank(*op, desc, rank, device, me, process_of_rank, in, out,
                      timeout_s, &tell);
  }
  if (!error.empty()) {
    // Local ranks that did join complete through the failure; this call was
    // never registered, so it completes here.
    if (tell) tr.fail(op, error, /*tell_peers=*/true);
    done(error);
    return;
  }
  run_rank(op, rank, std::move(done));
  // A peer lost between the check above and the join would not have seen
  // this op among those to fail.
  for (int p : process_of_rank) {
    const std::string dead = tr.dead_reason(p);
    if (!dead.empty()) {
      tr.fail(
          op,
          tagged(FailureKind::kPeerLost, p, op_name(key, desc) + ": " + dead),
          /*tell_peers=*/true);
      break;
    }
  }
}

}  // namespace jaxring
