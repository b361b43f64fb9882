// The receiving side of the TCP transport: the listener, the handshake every
// accepted connection must pass, and the reader that takes each frame apart
// and checks it against the local plan before any byte of it lands: a frame
// may only deliver a unit the plan has its sender's process send here, once.
#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <sstream>
#include <stdexcept>
#include <system_error>
#include <thread>

#include "cpu/plan/plan_executor.h"
#include "cpu/net/socket_io.h"
#include "cpu/net/tcp_transport_state.h"

namespace jaxring {

namespace {

// Receives the payload of a data frame into dest (a local buffer or a staged
// copy), switching to a scratch buffer if the operation fails meanwhile so
// that a failed rank can complete without waiting for the wire.
ReadResult receive_payload(int fd, PlanOp& op, char* dest, size_t n,
                           double stall_s, bool* released, std::string* error) {
  std::vector<char> scratch;
  while (n > 0) {
    if (!*released && op.failed_flag.load()) {
      std::vector<PlanWorker*> workers;
      {
        std::lock_guard<std::mutex> lock(op.mu);
        --op.writers;
        workers = op.workers();
      }
      *released = true;
      for (PlanWorker* w : workers) wake(w);
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
ReadResult drain_payload(int fd, int64_t n, double stall_s,
                         std::string* error) {
  char slice[64 * 1024];
  while (n > 0) {
    const size_t piece =
        static_cast<size_t>(std::min<int64_t>(n, sizeof(slice)));
    const ReadResult r = read_exact(fd, slice, piece, false, stall_s, error);
    if (r != ReadResult::kOk) return r;
    n -= static_cast<int64_t>(piece);
  }
  return ReadResult::kOk;
}

}  // namespace

int TcpTransport::listen(const std::string& bind_host,
                         const JobIdentity& identity, bool use_shm,
                         std::string* error) {
  std::lock_guard<std::mutex> lock(mu_);
  if (listen_fd_ >= 0) {
    const JobIdentity mine = this->identity();
    if (identity.process != mine.process ||
        identity.processes != mine.processes ||
        identity.secret != mine.secret || identity.job_id != mine.job_id) {
      *error = "the TCP transport already listens for another job identity";
      return -1;
    }
    if (use_shm != use_shm_.load()) {
      *error =
          "the TCP transport already listens with another shared-memory choice";
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
  use_shm_.store(use_shm);
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
    tune_socket(fd);  // accepted connections inherit its buffer sizes
    if (::bind(fd, ai->ai_addr, ai->ai_addrlen) == 0 &&
        ::listen(fd, 128) == 0) {
      break;
    }
    *error = std::string("bind/listen on ") + bind_host + ": " +
             std::strerror(errno);
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

void TcpTransport::accept_loop(int listen_fd) {
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
      note_refusal(std::string("this process cannot start a thread: ") +
                   e.what());
    }
  }
}

// One accepted connection, as its reader sees it.
struct TcpTransport::Inbound {
  int fd = -1;
  int self = -1;     // this process's index (identity(), known since listen)
  int peer = -1;     // the process it speaks for, once admitted
  int channel = -1;  // which of that process's links it is
  std::unique_ptr<ShmRing> ring;  // the shared-memory ring it offered, if any
  std::string error;              // why the last read failed
};

// Where a data frame's bytes go, decided under its operation's lock before
// any byte of it is read.
struct TcpTransport::Landing {
  char* dest = nullptr;
  // Where the unit is reduced on arrival (out of the ring): the rank's own
  // contribution, which a worker would otherwise reduce it with.
  const char* own = nullptr;
  bool own_first = false;  // the operand order (TieredPlan::own_first)
  ElemType type = ElemType::kF32;
  ReduceOp reduce_op = ReduceOp::kSum;
  double stall_s = 0;  // read under the lock: a joining rank may set it
  bool discard = false;
  std::string mismatch;  // the failure to report, when the frame is wrong
};

void TcpTransport::read_loop(int fd) {
  Inbound in;
  in.fd = fd;
  // This process's index, known since listen(); me() is only set once
  // set_peers has run, and a peer may connect before that.
  in.self = identity().process;
  if (!admit(in)) return;
  // From here on the connection speaks for process `in.peer`.
  struct Release {
    TcpTransport* t;
    int peer, channel;
    ~Release() {
      t->note_inbound_ring(peer, channel, false);
      t->release_inbound(peer, channel);
    }
  } release{this, in.peer, in.channel};
  if (!take_offer(in)) return;
  for (;;) {
    FrameHeader h{};
    ReadResult r = read_exact(fd, reinterpret_cast<char*>(&h), sizeof(h),
                              /*idle_ok=*/true, kConnectTimeoutS, &in.error);
    if (r == ReadResult::kOk && h.magic != kWireMagic) {
      in.error = "protocol error: bad frame magic";
      r = ReadResult::kError;
    }
    if (r != ReadResult::kOk) {
      ::close(fd);
      std::this_thread::sleep_for(kLostPeerGrace);
      peer_lost(in.peer, in.error);
      return;
    }
    Next next;
    if (!frame_fits(in, h)) {
      in.error = "protocol error: a frame of unknown kind or size";
      next = Next::kLost;
    } else if (h.kind == kAbort || h.kind == kPeerLost) {
      next = on_message_frame(in, h);
    } else if (!plausible_data_header(h)) {
      // Nothing this build sends: a stranger or garbage. The connection
      // goes, quietly: no state is made for it, and no process is blamed.
      next = Next::kQuiet;
    } else {
      next = on_data_frame(in, h);
    }
    if (next == Next::kContinue) continue;
    ::close(fd);
    if (next == Next::kLost) peer_lost(in.peer, in.error);
    return;
  }
}

bool TcpTransport::admit(Inbound& in) {
  const bool proved =
      accept_handshake(in.fd, identity(), after_seconds(kHandshakeTimeoutS),
                       &in.peer, &in.channel, &in.error);
  --handshaking_;
  if (proved && claim_inbound(in.peer, in.channel)) return true;
  // A stranger, another job, or a second connection for a channel already
  // open: it goes quietly, and no process of the job is blamed.
  ::close(in.fd);
  note_refusal(proved ? "a second connection from process " +
                            std::to_string(in.peer) + " for channel " +
                            std::to_string(in.channel)
                      : in.error);
  return false;
}

bool TcpTransport::take_offer(Inbound& in) {
  // The connection's first words offer a shared-memory ring (or say there
  // is none); a connection that breaks meanwhile goes quietly, like one
  // whose handshake failed: the connector's end reports it.
  std::string declined;
  if (!answer_offer(in.fd, use_shm(), identity().job_id, in.peer, in.self,
                    in.channel, after_seconds(kHandshakeTimeoutS), &in.ring,
                    &declined, &in.error)) {
    ::close(in.fd);
    note_refusal("process " + std::to_string(in.peer) + ": " + in.error);
    return false;
  }
  if (use_shm() && !declined.empty()) note_shm_unavailable(declined);
  note_inbound_ring(in.peer, in.channel, in.ring != nullptr);
  return true;
}

bool TcpTransport::frame_fits(const Inbound& in, const FrameHeader& h) {
  const bool message_frame = h.kind == kAbort || h.kind == kPeerLost;
  const bool ring_frame = h.kind == kShmData;
  if (!message_frame && h.kind != kData && !ring_frame) return false;
  if (h.payload_bytes < 0) return false;
  if (h.payload_bytes > (message_frame ? kMaxMessageBytes : kMaxPayloadBytes))
    return false;
  return !ring_frame || (in.ring && in.ring->carries(h.payload_bytes));
}

ReadResult TcpTransport::skip_payload(Inbound& in, const FrameHeader& h,
                                      double stall_s) {
  if (h.kind != kShmData)
    return drain_payload(in.fd, h.payload_bytes, stall_s, &in.error);
  if (!in.ring->next(h.payload_bytes, &in.error)) return ReadResult::kError;
  in.ring->release(h.payload_bytes);
  return ReadResult::kOk;
}

TcpTransport::Next TcpTransport::on_message_frame(Inbound& in,
                                                  const FrameHeader& h) {
  std::string message(static_cast<size_t>(h.payload_bytes), '\0');
  if (read_exact(in.fd, message.data(), message.size(), false, kConnectTimeoutS,
                 &in.error) != ReadResult::kOk) {
    return Next::kLost;
  }
  // The sender's words are kept as text only: its own tag is dropped, and
  // this process tags the failure from the header's numbers.
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
  // The process the sender's failure points at, or else the sender. A
  // report that points at this process, which is running, comes from a
  // peer that waited on it while it waited on a stopped process further up
  // the ring: the sender cannot tell which one stopped, so it names none.
  int points_at =
      h.src_rank >= 0 && h.src_rank < processes ? h.src_rank : in.peer;
  if (points_at == in.self) points_at = -1;
  std::ostringstream os;
  os << words << " [reported by process " << in.peer << "]";
  if (h.kind == kPeerLost) {
    // Only about another process of the job: a process cannot report
    // itself or this one lost.
    const int lost =
        h.group >= 0 && h.group < processes ? static_cast<int>(h.group) : -1;
    if (lost >= 0 && lost != in.peer && lost != in.self) {
      peer_lost(lost, os.str(), /*tell_others=*/false);
    }
  } else if (std::shared_ptr<PlanOp> target = op_for_frame(key_of(h))) {
    fail(target, tagged(kind, points_at, os.str()), /*tell_peers=*/false);
  }
  return Next::kContinue;
}

TcpTransport::Next TcpTransport::on_data_frame(Inbound& in,
                                               const FrameHeader& h) {
  std::shared_ptr<PlanOp> op_ptr = op_for_frame(key_of(h));
  if (!op_ptr) {
    // Too many operations ahead of this process: the sender's fails, and
    // says why, instead of waiting out its timeout.
    std::ostringstream os;
    os << "jaxring allreduce (op " << h.op_id << ", group " << h.group
       << ", run " << h.run_id << "): process " << in.self << " holds "
       << kMaxFrameCreatedOps
       << " operations that peers started and it did not, and refuses more: "
          "the processes do not run the same allreduces";
    send_abort(in.peer, key_of(h), FailureKind::kResource,
               tagged(FailureKind::kResource, in.self, os.str()));
    return skip_payload(in, h, kConnectTimeoutS) == ReadResult::kOk
               ? Next::kContinue
               : Next::kLost;
  }
  PlanOp& o = *op_ptr;
  const Landing at = land(in, h, o);
  if (!at.mismatch.empty()) fail(op_ptr, at.mismatch, /*tell_peers=*/true);
  bool released = at.discard;
  ReadResult r;
  if (at.discard) {
    r = skip_payload(in, h, at.stall_s);
  } else if (h.kind == kShmData) {
    r = take_from_ring(in, h, at);
  } else {
    r = receive_payload(in.fd, o, at.dest, static_cast<size_t>(h.payload_bytes),
                        at.stall_s, &released, &in.error);
  }
  arrived(h, o, at, r == ReadResult::kOk, released);
  return r == ReadResult::kOk ? Next::kContinue : Next::kLost;
}

TcpTransport::Landing TcpTransport::land(const Inbound& in,
                                         const FrameHeader& h, PlanOp& o) {
  Landing at;
  std::lock_guard<std::mutex> lock(o.mu);
  at.stall_s = o.timeout_s;
  Span span;
  if (o.failed || !agrees(in, h, o, &at) || !fits_plan(in, h, o, &span, &at)) {
    at.discard = true;
    return at;
  }
  const TieredPlan& plan = *o.plan;
  const int64_t esize = plan.elem_bytes();
  Inbox& ib = o.inbox(h.dst_rank, h.ring);
  auto local = o.locals.find(h.dst_rank);
  if (local != o.locals.end() && h.phase == ib.phase) {
    at.dest = static_cast<char*>(local->second.out) + span.offset * esize;
    if (h.kind == kShmData && plan.is_reduce_unit(h.phase, h.unit)) {
      at.own =
          local->second.own_contribution(h.ring, h.phase, span.offset, esize);
      at.own_first = plan.own_first(h.phase, h.dst_rank);
      at.type = o.desc.type;
      at.reduce_op = o.desc.op;
    }
  } else if (!stage(in, h, o, ib, &at)) {
    return at;
  }
  ib.received.insert({h.phase, h.unit});
  o.heard_from.insert(in.peer);
  ++o.writers;
  return at;
}

bool TcpTransport::agrees(const Inbound& in, const FrameHeader& h, PlanOp& o,
                          Landing* at) {
  const OpDesc theirs = desc_of(h);
  if (!o.has_desc) {
    // The first word of an operation this process has not reached.
    try {
      ReduceOp unused;
      if (h.elem_type < 0 || h.elem_type > static_cast<int>(ElemType::kU64) ||
          !reduce_op_from_int(h.reduce_op, &unused)) {
        throw std::invalid_argument("unknown element type or reduction");
      }
      o.set_desc(theirs);
      o.first_sender = in.peer;
      return true;
    } catch (const std::exception& e) {
      at->mismatch = tagged(FailureKind::kMismatch, in.peer,
                            o.name() + ": protocol error: " + e.what());
      return false;
    }
  }
  if (same_operation(o.desc, theirs)) return true;
  std::ostringstream os;
  os << o.name() << ": rank " << h.src_rank << " (process " << in.peer
     << ") called it with " << theirs.describe()
     << ". Every rank must pass the same shape, dtype and op.";
  at->mismatch = tagged(FailureKind::kMismatch, in.peer, os.str());
  return false;
}

bool TcpTransport::fits_plan(const Inbound& in, const FrameHeader& h, PlanOp& o,
                             Span* span, Landing* at) {
  const TieredPlan& plan = *o.plan;
  const int64_t unit = h.unit;
  const bool in_plan =
      h.ring >= 0 && h.ring < o.desc.num_rings && h.dst_rank >= 0 &&
      h.dst_rank < o.desc.world_size && h.phase >= 0 &&
      h.phase < plan.num_phases() && unit >= 0 &&
      unit < plan.num_units(h.ring, h.phase, h.dst_rank) &&
      h.src_rank == plan.prev_rank(h.ring, h.phase, h.dst_rank) &&
      h.phase >= o.inbox(h.dst_rank, h.ring).phase;
  *span =
      in_plan ? plan.recv_span(h.ring, h.phase, h.dst_rank, unit) : Span{0, -1};
  // Once a local rank has joined, the plan says which process runs each
  // rank: a frame from a rank must come over a connection from that rank's
  // process.
  const bool from_its_process =
      o.process_of_rank.empty() ||
      (h.src_rank < static_cast<int64_t>(o.process_of_rank.size()) &&
       o.process_of_rank[h.src_rank] == in.peer);
  // Empty units are never sent, and a unit the plan sends once cannot come
  // twice: a second copy would be counted again (or free a staged buffer
  // the worker may be reading). Only a broken peer sends these.
  if (in_plan && from_its_process && span->count != 0 &&
      span->count * plan.elem_bytes() == h.payload_bytes &&
      !o.inbox(h.dst_rank, h.ring).received.count({h.phase, unit})) {
    return true;
  }
  at->mismatch =
      tagged(FailureKind::kMismatch, in.peer,
             o.name() + ": protocol error: a frame does not fit the plan");
  return false;
}

bool TcpTransport::stage(const Inbound& in, const FrameHeader& h, PlanOp& o,
                         Inbox& ib, Landing* at) {
  try {
    if (StagingPool::get().in_use() + h.payload_bytes > kMaxStagedFromWire) {
      throw std::bad_alloc();
    }
    Staged staged(static_cast<size_t>(h.payload_bytes));
    staged.from_process = in.peer;
    at->dest = staged.data.get();
    ib.staged[{h.phase, h.unit}] = std::move(staged);
    return true;
  } catch (const std::bad_alloc&) {
    std::ostringstream os;
    os << o.name() << ": cannot stage " << h.payload_bytes
       << " more bytes from process " << in.peer << " (this process "
       << "holds " << StagingPool::get().in_use() << " bytes of "
       << "frames for operations it has not reached, at most "
       << kMaxStagedFromWire << ")";
    at->mismatch = tagged(FailureKind::kResource, in.peer, os.str());
    at->discard = true;
    return false;
  }
}

ReadResult TcpTransport::take_from_ring(Inbound& in, const FrameHeader& h,
                                        const Landing& at) {
  // Out of the ring: reduced straight into the result where it can be, else
  // copied to where it goes. The operation's writers count keeps a failed
  // rank from completing meanwhile.
  const int64_t n = h.payload_bytes;
  const char* src = in.ring->next(n, &in.error);
  if (!src) return ReadResult::kError;
  if (at.own && at.own_first) {
    reduce(at.type, at.reduce_op, at.dest, at.own, src,
           n / elem_bytes(at.type));
  } else if (at.own) {
    reduce(at.type, at.reduce_op, at.dest, src, at.own,
           n / elem_bytes(at.type));
  } else {
    std::memcpy(at.dest, src, static_cast<size_t>(n));
  }
  in.ring->release(n);
  return ReadResult::kOk;
}

void TcpTransport::arrived(const FrameHeader& h, PlanOp& o, const Landing& at,
                           bool ok, bool released) {
  std::vector<PlanWorker*> workers;
  {
    std::lock_guard<std::mutex> lock(o.mu);
    if (!released) {
      --o.writers;
      if (ok && !o.failed) {
        Inbox& ib = o.inbox(h.dst_rank, h.ring);
        if (at.own) ib.reduced_on_arrival.insert({h.phase, h.unit});
        ib.ready[h.phase].push_back(h.unit);
        ++ib.arrived[h.phase];
        auto local = o.locals.find(h.dst_rank);
        if (local != o.locals.end()) workers.push_back(local->second.worker);
      }
    }
    if (o.failed) workers = o.workers();
  }
  for (PlanWorker* w : workers) wake(w);
}

}  // namespace jaxring
