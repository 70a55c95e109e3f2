// Proposers: where a step's draft window comes from (runtime/proposers.py).
//   TargetOnly (ar)  no window; the target decodes one token per step
//   SerialDraft (sd) the draft rolls out g tokens after the verdict, serially with the target (rollout::fresh)
//   MirrorProposer   see mirror.hpp: windows come from branches rolled out while the target verifies
// Every proposer has the same methods, so the decode loop is written once.
#pragma once

#include <cstdint>
#include <vector>

#include "models.hpp"
#include "verify.hpp"

namespace mirrorsd {

struct Proposal {
  std::vector<int64_t> tokens;  // [g] draft tokens following the last committed token
  bool reused = false;          // taken from a branch rolled out before the verdict (Mirror-SD)
  int64_t draft_forwards = 0;   // draft graph calls spent on this window after the previous verdict
};

class Proposer {
 public:
  virtual ~Proposer() = default;
  virtual void reset(const std::vector<int64_t>& prompt) { (void)prompt; }
  virtual Proposal propose(const std::vector<int64_t>& committed, int gamma) {
    (void)committed, (void)gamma;
    return {};
  }
  virtual const ExitCallback* exit_callback() { return nullptr; }  // the early-exit hand-off, if used
  virtual void observe(const Verdict& verdict, const std::vector<int64_t>& new_tokens, int next_gamma) {
    (void)verdict, (void)new_tokens, (void)next_gamma;
  }
  virtual void finish(double timeout_s = -1) { (void)timeout_s; }  // stop any worker (-1: the proposer's own timeout)
};

using TargetOnly = Proposer;  // the defaults are exactly target-only decoding

class SerialDraft : public Proposer {
 public:
  explicit SerialDraft(DraftModel& draft) : draft_(draft) {}
  void reset(const std::vector<int64_t>& prompt) override;
  Proposal propose(const std::vector<int64_t>& committed, int gamma) override;

 private:
  DraftModel& draft_;
};

}  // namespace mirrorsd
