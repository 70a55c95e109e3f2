// Mirror-SD's draft worker: owns the draft model on its own std::thread and answers each verdict with the next window
// (DraftWorker in runtime/mirror.py, same protocol, same ranking, same cache bookkeeping).
//
//   main thread (target device)                     draft worker (draft device)
//   propose(): wait for a window        <-- Window --  fresh rollout, or a ready branch
//   prefix([last] + window)                          extend: one forward on the window's last token
//   exit head -> top-k per position     -- Exit ---> re-rank candidate branches (draft runner-ups first)
//   suffix -> target tokens -> verdict               roll out branches (d, v) in batches, best first,
//   observe(verdict)                    -- Verdict->   until the verdict arrives or the cap is reached
//                                                    branch (A+1, c) ready? adopt its KV + tokens (reuse)
//                                                    else roll out afresh (fallback)
// Only token ids and log-probs cross between the threads. Nothing busy-waits: the worker polls its inbox between
// draft forwards and blocks when it has nothing to do.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <variant>
#include <vector>

#include "errors.hpp"
#include "mailbox.hpp"
#include "models.hpp"
#include "proposers.hpp"
#include "rollout.hpp"
#include "settings.hpp"

namespace mirrorsd {

// runtime/config.py's MirrorSettings (names and defaults: settings.hpp, generated from it).
struct MirrorSettings {
  int branches = settings::kBranches;          // branches rolled out per step at most (the cap beside the time budget)
  int branch_batch = settings::kBranchBatch;   // branches per batched rollout
  int runner_up_k = settings::kRunnerUpK;      // the draft's own candidate tokens kept per window position
  settings::BranchBudget branch_budget = settings::kBranchBudget;  // Time: stop at the verdict (the paper's overlap
                                                                   // budget); Cap: always roll out `branches`
  bool exit_head = settings::kExitHead;        // hand the early exit's top-k to the worker
  double draft_timeout_s = settings::kDraftTimeoutS;  // the main thread gives up on a silent worker after this long
  bool operator==(const MirrorSettings& o) const {
    return branches == o.branches && branch_batch == o.branch_batch && runner_up_k == o.runner_up_k &&
           branch_budget == o.branch_budget && exit_head == o.exit_head && draft_timeout_s == o.draft_timeout_s;
  }
};

// Messages, main -> worker.
struct PrefillMsg { std::vector<int64_t> tokens; };
struct ProposeMsg { std::vector<int64_t> committed; int gamma = 0; };
struct ExitMsg { std::vector<int64_t> ids; std::vector<float> logprobs; int64_t k = 0; };  // [g + 1, k]
struct VerdictMsg { Verdict verdict; std::vector<int64_t> new_tokens; int gamma = 0; };
struct StopMsg {};
using Message = std::variant<PrefillMsg, ProposeMsg, ExitMsg, VerdictMsg, StopMsg>;

// Worker -> main: a window, or the failure that ended the worker.
struct Reply {
  bool failed = false;
  Proposal proposal;
  Code code = Code::Internal;
  std::string error;
};

// Running per-token acceptance probability: accepted / (accepted + rejections), exponentially decayed.
struct AcceptanceEstimate {
  double accepted = 7.0, rejected = 3.0, decay = 0.95;  // prior: 0.7 with the weight of a few steps
  double rate() const { return accepted / (accepted + rejected); }
  void update(const Verdict& v) {
    accepted = decay * accepted + v.accepted;
    rejected = decay * rejected + (v.bonus() ? 0 : 1);
  }
};

class DraftWorker {
 public:
  DraftWorker(DraftModel& draft, const MirrorSettings& settings) : draft_(draft), settings_(settings) {}
  ~DraftWorker();
  void start();
  bool wait_exit(double seconds);  // true once the thread body has returned
  void join();

  Mailbox<Message> inbox;
  Mailbox<Reply> outbox;
  int64_t branches = 0;  // branches rolled out (read after join)

 private:
  struct Window {
    std::vector<int64_t> tokens;      // [g]
    std::vector<int64_t> top_ids;     // [g + 1, k] (row g filled by the extend forward)
    std::vector<float> top_logprobs;
    int64_t base_length = 0;          // committed tokens when the window was drafted (C)
  };
  struct Ready {
    std::shared_ptr<const rollout::Branches> rolled;  // the batch holding this branch as row `row`
    int64_t row = 0;                                  // its rollout: the next window if the verdict hits it
  };
  using Key = std::pair<int, int64_t>;

  void body();
  Message serve(Message message);
  Window fresh(int gamma);
  void deliver(const Window& window, bool reused);
  Window next_window(const Window& window, const VerdictMsg& message, bool& reused);
  Message speculate(Window& window);
  void extend_last(Window& window);
  std::optional<Message> roll_out(const Window& window, const std::vector<Branch>& batch, bool abandon);
  bool after_forward(const std::vector<Branch>& batch, std::optional<Message>& message, bool abandon);

  DraftModel& draft_;
  MirrorSettings settings_;
  std::vector<int64_t> committed_;
  std::map<Key, Ready> ready_;
  AcceptanceEstimate acceptance_;
  int64_t forwards_since_verdict_ = 0;
  std::thread thread_;
  std::mutex exit_lock_;
  std::condition_variable exited_cv_;
  bool exited_ = false;
};

}  // namespace mirrorsd
