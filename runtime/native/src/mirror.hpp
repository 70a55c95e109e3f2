// The main thread's side of Mirror-SD (MirrorProposer in runtime/mirror.py): posts messages to the draft worker
// (mirror_worker.hpp) and waits for its windows. One worker thread per generation; a worker failure or a silent
// worker reaches the caller as Error(DraftWorker).
#pragma once

#include <memory>

#include "mirror_worker.hpp"

namespace mirrorsd {

class MirrorProposer : public Proposer {
 public:
  MirrorProposer(DraftModel& draft, const MirrorSettings& settings);
  ~MirrorProposer() override;

  void reset(const std::vector<int64_t>& prompt) override;
  Proposal propose(const std::vector<int64_t>& committed, int gamma) override;
  const ExitCallback* exit_callback() override;
  void observe(const Verdict& verdict, const std::vector<int64_t>& new_tokens, int next_gamma) override;
  void finish(double timeout_s = -1) override;

  int64_t branches() const { return branches_; }  // branches rolled out by the last finished worker

 private:
  [[noreturn]] void fail(const std::string& what, const std::string& why, const std::string& fix);
  void wait_for_stuck();

  DraftModel& draft_;
  MirrorSettings settings_;
  std::unique_ptr<DraftWorker> worker_, stuck_;  // stuck_: a stopped worker still inside a draft call
  ExitCallback exit_callback_;
  bool awaiting_window_ = false, active_ = false;
  int64_t branches_ = 0;
};

}  // namespace mirrorsd
