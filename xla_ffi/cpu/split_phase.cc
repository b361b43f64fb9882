#include "cpu/split_phase.h"

#include <algorithm>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <tuple>
#include <utility>

#include "failure.h"
#include "cpu/buffer_pool.h"
#include "cpu/gang_start.h"

namespace jaxring {

namespace {

struct StartKey {
  int64_t run_id;
  int device;
  int64_t op_id;
  bool operator<(const StartKey& o) const {
    return std::tie(run_id, device, op_id) <
           std::tie(o.run_id, o.device, o.op_id);
  }
};

// One device's started operation.
struct Started {
  PooledBuffer in;
  PooledBuffer out;
  size_t bytes = 0;
  std::mutex mu;
  bool complete = false;
  std::optional<std::string> error;
  // Set by finish when it arrives before completion; run on completion.
  std::function<void()> on_complete;
};

class StartTable {
 public:
  static StartTable& get() {
    // Leaked on purpose, like the transport's workers: a program still
    // running at interpreter exit may complete into it.
    static StartTable* t = new StartTable();
    return *t;
  }

  bool insert(const StartKey& k, std::shared_ptr<Started> s) {
    std::lock_guard<std::mutex> lock(mu_);
    return table_.emplace(k, std::move(s)).second;
  }

  std::shared_ptr<Started> take(const StartKey& k) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = table_.find(k);
    if (it == table_.end()) return nullptr;
    std::shared_ptr<Started> s = std::move(it->second);
    table_.erase(it);
    return s;
  }

  int64_t size() {
    std::lock_guard<std::mutex> lock(mu_);
    return static_cast<int64_t>(table_.size());
  }

 private:
  std::mutex mu_;
  std::map<StartKey, std::shared_ptr<Started>> table_;
};

void mark_complete(Started& s, const std::optional<std::string>& error) {
  std::function<void()> then;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    s.complete = true;
    s.error = error;
    then = std::move(s.on_complete);
    s.on_complete = nullptr;
  }
  if (then) then();
}

void copy_out(const Started& s, const std::vector<MutableBytes>& outputs) {
  size_t at = 0;
  for (const MutableBytes& o : outputs) {
    if (o.size > 0) std::memcpy(o.data, s.out.get() + at, o.size);
    at += o.size;
  }
}

}  // namespace

std::optional<std::string> split_phase_start(
    const OpKey& key, const OpDesc& desc, int rank, int device,
    const std::vector<int>& process_of_rank,
    const std::vector<ConstBytes>& inputs, double timeout_s, bool gang) {
  auto s = std::make_shared<Started>();
  for (const ConstBytes& b : inputs) s->bytes += b.size;
  const size_t expected =
      static_cast<size_t>(desc.count) * elem_bytes(desc.type);
  if (s->bytes != expected) {
    std::ostringstream os;
    os << "jaxring allreduce start (op " << key.op_id << "): inputs hold "
       << s->bytes << " bytes but the operation describes " << expected;
    return tagged(FailureKind::kInvalid, -1, os.str());
  }
  s->in = acquire_buffer(s->bytes);
  size_t at = 0;
  for (const ConstBytes& b : inputs) {
    if (b.size > 0) std::memcpy(s->in.get() + at, b.data, b.size);
    at += b.size;
  }
  const StartKey sk{key.run_id, device, key.op_id};
  if (!StartTable::get().insert(sk, s)) {
    std::ostringstream os;
    os << "jaxring allreduce start (op " << key.op_id << ", run " << key.run_id
       << "): started twice on device " << device
       << " without a finish in between";
    return tagged(FailureKind::kInvalid, -1, os.str());
  }
  if (desc.world_size == 1) {
    s->out = std::move(s->in);
    mark_complete(*s, std::nullopt);
    return std::nullopt;
  }
  s->out = acquire_buffer(s->bytes);
  // The completion holds the entry, so the buffers outlive every peer read
  // even if finish never comes.
  cpu_allreduce(key, desc, rank, device, process_of_rank, s->in.get(),
                s->out.get(), timeout_s,
                [s](const std::optional<std::string>& error) {
                  mark_complete(*s, error);
                });
  const bool one_process =
      std::all_of(process_of_rank.begin(), process_of_rank.end(),
                  [&](int p) { return p == process_of_rank.front(); });
  if (gang && one_process) {
    gang_start_wait(key, desc.world_size, std::min(timeout_s, kGangMaxWaitS));
  }
  return std::nullopt;
}

void split_phase_finish(int64_t run_id, int device, int64_t op_id,
                        std::vector<MutableBytes> outputs, Completion done) {
  std::shared_ptr<Started> s = StartTable::get().take({run_id, device, op_id});
  if (!s) {
    std::ostringstream os;
    os << "jaxring allreduce done (op " << op_id << ", run " << run_id
       << "): no matching start on device " << device
       << " (the start failed or never ran)";
    done(tagged(FailureKind::kInvalid, -1, os.str()));
    return;
  }
  size_t total = 0;
  for (const MutableBytes& o : outputs) total += o.size;
  if (total != s->bytes) {
    std::ostringstream os;
    os << "jaxring allreduce done (op " << op_id << "): outputs hold " << total
       << " bytes but the start was given " << s->bytes;
    // Fail at once. The operation itself runs on: the transport's
    // completion holds the entry, so peers can still read its buffers.
    done(tagged(FailureKind::kInvalid, -1, os.str()));
    return;
  }
  auto finish_now = [s, outputs = std::move(outputs), done = std::move(done)] {
    if (!s->error) copy_out(*s, outputs);
    done(s->error);
  };
  {
    std::unique_lock<std::mutex> lock(s->mu);
    if (!s->complete) {
      s->on_complete = std::move(finish_now);
      return;
    }
  }
  finish_now();
}

int64_t split_phase_unfinished_starts() { return StartTable::get().size(); }

}  // namespace jaxring
