#include "mirror.hpp"

namespace mirrorsd {

MirrorProposer::MirrorProposer(DraftModel& draft, const MirrorSettings& settings)
    : draft_(draft), settings_(settings) {}

MirrorProposer::~MirrorProposer() {
  try {
    finish();
  } catch (const Error&) {
  }
  // No worker may outlive the draft model it writes to: wait for a stuck one however long its call takes.
  if (stuck_) stuck_->join();
}

void MirrorProposer::reset(const std::vector<int64_t>& prompt) {
  finish();
  wait_for_stuck();
  worker_ = std::make_unique<DraftWorker>(draft_, settings_);
  worker_->start();
  awaiting_window_ = false;
  active_ = true;
  Mailbox<Message>* inbox = &worker_->inbox;
  exit_callback_ = [inbox](const int64_t* ids, const float* logprobs, int64_t positions, int64_t k) {
    inbox->put(ExitMsg{std::vector<int64_t>(ids, ids + positions * k),
                       std::vector<float>(logprobs, logprobs + positions * k), k});
  };
  worker_->inbox.put(PrefillMsg{prompt});
}

void MirrorProposer::fail(const std::string& what, const std::string& why, const std::string& fix) {
  active_ = false;
  throw Error(Code::DraftWorker, what, why, fix);
}

Proposal MirrorProposer::propose(const std::vector<int64_t>& committed, int gamma) {
  if (!worker_) fail("The draft worker is not running", "generation was not started", "");
  if (!awaiting_window_) worker_->inbox.put(ProposeMsg{committed, gamma});
  awaiting_window_ = false;
  std::optional<Reply> reply = worker_->outbox.get_for(settings_.draft_timeout_s);
  if (!reply)
    fail("The draft worker did not deliver a window",
         "no answer within " + std::to_string(static_cast<int64_t>(settings_.draft_timeout_s)) +
             " s (a hung draft device?)",
         "check the draft device, or raise draft_timeout_s");
  if (reply->failed)
    fail("The draft worker failed", reply->error, "the target itself is unaffected");
  if (static_cast<int>(reply->proposal.tokens.size()) < gamma)
    fail("The draft worker returned a malformed window",
         "it has " + std::to_string(reply->proposal.tokens.size()) + " tokens, " + std::to_string(gamma) + " wanted",
         "this is a bug in the draft graph or worker; please report it");
  return std::move(reply->proposal);
}

const ExitCallback* MirrorProposer::exit_callback() {
  return active_ && settings_.exit_head ? &exit_callback_ : nullptr;
}

void MirrorProposer::observe(const Verdict& verdict, const std::vector<int64_t>& new_tokens, int next_gamma) {
  if (!active_) return;
  worker_->inbox.put(VerdictMsg{verdict, new_tokens, next_gamma});
  awaiting_window_ = true;
}

// Stop and join the worker; a worker stuck in a draft call for longer than the timeout is an error.
void MirrorProposer::finish(double timeout_s) {
  active_ = awaiting_window_ = false;
  if (!worker_) return;
  std::unique_ptr<DraftWorker> worker = std::move(worker_);
  worker->inbox.put(StopMsg{});
  if (!worker->wait_exit(timeout_s < 0 ? settings_.draft_timeout_s : timeout_s)) {
    stuck_ = std::move(worker);  // it exits when its call returns (it finds Stop); until then it owns the draft
    throw Error(Code::DraftWorker, "The draft worker did not stop", "a draft graph call is still running",
                "the draft device may be hung; close the model to wait for it");
  }
  worker->join();
  branches_ = worker->branches;
}

// No second worker may touch the draft model while a stuck one may still write to its caches.
void MirrorProposer::wait_for_stuck() {
  if (!stuck_) return;
  if (!stuck_->wait_exit(settings_.draft_timeout_s))
    throw Error(Code::DraftWorker, "The previous draft worker is still inside a draft call",
                "a new worker would share the draft model with it",
                "the draft device may be hung: retry later, use mode ar, or close the model");
  stuck_->join();
  stuck_.reset();
}

}  // namespace mirrorsd
