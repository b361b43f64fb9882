// How a failure spreads through the TCP transport: an operation that fails
// here fails on every process that runs ranks of it (abort frames), a process
// that cannot be reached fails every operation that needs it and is reported
// to the others (peer-lost frames), and processes that run different
// programs at one call site are told so instead of waiting out a timeout.
#include <algorithm>
#include <sstream>

#include "cpu/plan/plan_executor.h"
#include "cpu/net/tcp_transport_state.h"

namespace jaxring {

bool TcpTransport::fail(const std::shared_ptr<PlanOp>& op,
                        const std::string& why, bool tell_peers) {
  std::vector<PlanWorker*> workers;
  std::set<int> peers;
  FrameHeader h{};
  {
    std::lock_guard<std::mutex> lock(op->mu);
    if (!op->mark_failed(why)) return false;
    workers = op->workers();
    if (tell_peers) {
      for (int p : op->process_of_rank) {
        if (p != identity().process) peers.insert(p);
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
    for (auto& [key, link] : links_)
      links.push_back(link.get());  // never freed
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
  for (PlanWorker* w : workers) wake(w);
  return true;
}

void TcpTransport::peer_lost(int p, const std::string& why, bool tell_others) {
  if (p < 0) return;
  std::vector<std::shared_ptr<PlanOp>> affected;
  std::string reason;
  int processes;
  {
    std::lock_guard<std::mutex> lock(links_mu_);
    if (dead_.count(p)) return;
    // From listen() on (before set_peers, the notices wait in send()).
    processes = identity().processes;
    if (tell_others) {
      std::ostringstream os;
      os << "process " << p << " ("
         << (p < static_cast<int>(addresses_.size()) ? addresses_[p]
                                                     : std::string("?"))
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
      if (q == p || q == identity().process) continue;
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
      involved =
          std::find(op->process_of_rank.begin(), op->process_of_rank.end(),
                    p) != op->process_of_rank.end();
      name = op->name();
    }
    if (involved) {
      fail(op, tagged(FailureKind::kPeerLost, p, name + ": " + reason),
           /*tell_peers=*/true);
    }
  }
}

void TcpTransport::check_programs_agree(const std::shared_ptr<PlanOp>& op) {
  std::vector<std::shared_ptr<PlanOp>> same_site;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [k, other] : ops_) {
      if (k.group == op->key.group && other != op) {
        same_site.push_back(other);  // same slot? checked under its lock
      }
    }
  }
  for (auto& other : same_site) {
    std::shared_ptr<PlanOp> local = op, remote = other;
    std::string message;
    {
      std::scoped_lock lock(op->mu, other->mu);
      if (op->locals.empty()) std::swap(local, remote);
      // A local operation that heard from the remote one's sender runs the
      // same program as that sender: the remote one is a later program's.
      if (local->locals.empty() || !remote->locals.empty() || local->failed ||
          remote->failed || !local->has_desc || !remote->has_desc ||
          local->desc.slot_id == 0 ||
          local->desc.slot_id != remote->desc.slot_id ||
          same_operation(local->desc, remote->desc) ||
          local->heard_from.count(remote->first_sender) || !local->plan ||
          local->process_of_rank.empty() ||
          !local->expects_data_from(remote->first_sender)) {
        continue;
      }
      std::ostringstream os;
      os << "jaxring allreduce (op " << local->key.op_id << ", group "
         << local->key.group << "): the processes run different programs: "
         << "process " << me() << " calls it with " << local->desc.describe()
         << " but process " << remote->first_sender << " with "
         << remote->desc.describe()
         << shape_difference(local->desc.shape_digest,
                             remote->desc.shape_digest)
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

}  // namespace jaxring
