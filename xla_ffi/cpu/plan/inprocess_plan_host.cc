#include "cpu/plan/inprocess_plan_host.h"

#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "failure.h"
#include "cpu/plan/plan_executor.h"

namespace jaxring {

namespace {

// The OpHost of operations whose ranks are all in this process: there is no
// remote rank to send to and no peer process to tell about a failure.
class InProcessPlanHost final : public OpHost {
 public:
  static InProcessPlanHost& get() {
    // Leaked on purpose: workers may use it during interpreter shutdown.
    static InProcessPlanHost* h = new InProcessPlanHost();
    return *h;
  }

  // The operation for key, created if new.
  std::shared_ptr<PlanOp> op(const OpKey& key) {
    std::lock_guard<std::mutex> lock(mu_);
    collect_garbage();
    auto& slot = ops_[key];
    if (!slot) slot = std::make_shared<PlanOp>(key, this);
    return slot;
  }

  int64_t pending() {
    std::lock_guard<std::mutex> lock(mu_);
    collect_garbage();  // as the in-process transport's pending()
    return static_cast<int64_t>(ops_.size());
  }

  int process() const override { return 0; }

  std::string send_remote(const std::shared_ptr<PlanOp>& op, int, int, int,
                          int64_t, const char*, int64_t) override {
    // Every rank runs here (process_of_rank is all zeros): never reached.
    return tagged(
        FailureKind::kInternal, -1,
        op->name() + ": a unit for another process in a one-process plan");
  }

  void fail(const std::shared_ptr<PlanOp>& op,
            const std::string& why) override {
    std::vector<PlanWorker*> workers;
    {
      std::lock_guard<std::mutex> lock(op->mu);
      if (!op->mark_failed(why)) return;
      workers = op->workers();
    }
    for (PlanWorker* w : workers) wake(w);
  }

  void forget(const std::shared_ptr<PlanOp>& op) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = ops_.find(op->key);
    if (it != ops_.end() && it->second == op) ops_.erase(it);
  }

  // One process runs one program: nothing to compare.
  void check_programs_agree(const std::shared_ptr<PlanOp>&) override {}

 private:
  // An operation whose ranks never all arrived stays (failed, once the
  // ranks that did arrive time out) so that latecomers fail fast with its
  // error; it goes a timeout after its deadline. Requires mu_.
  void collect_garbage() {
    const auto now = Clock::now();
    for (auto it = ops_.begin(); it != ops_.end();) {
      PlanOp& op = *it->second;
      bool drop;
      {
        std::lock_guard<std::mutex> lock(op.mu);
        const auto grace = std::chrono::duration_cast<Clock::duration>(
            std::chrono::duration<double>(op.timeout_s));
        drop = op.failed && now > op.deadline + grace;
      }
      it = drop ? ops_.erase(it) : std::next(it);
    }
  }

  // Lock order: mu_ may be held while taking an operation's mu, never the
  // other way round.
  std::mutex mu_;
  std::map<OpKey, std::shared_ptr<PlanOp>> ops_;
};

}  // namespace

void inprocess_plan_allreduce(const OpKey& key, const OpDesc& desc, int rank,
                              int device, const void* in, void* out,
                              double timeout_s, Completion done) {
  InProcessPlanHost& host = InProcessPlanHost::get();
  std::shared_ptr<PlanOp> op = host.op(key);
  std::string error;
  bool fails_all = false;
  {
    std::lock_guard<std::mutex> lock(op->mu);
    error = join_rank(*op, desc, rank, device, host.process(),
                      std::vector<int>(desc.world_size, host.process()), in,
                      out, timeout_s, &fails_all);
  }
  if (!error.empty()) {
    if (fails_all) host.fail(op, error);
    done(error);
    return;
  }
  run_rank(std::move(op), rank, std::move(done));
}

int64_t inprocess_plan_pending_ops() {
  return InProcessPlanHost::get().pending();
}

}  // namespace jaxring
