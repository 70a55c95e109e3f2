#include "proposers.hpp"

#include "errors.hpp"
#include "rollout.hpp"

namespace mirrorsd {

void SerialDraft::reset(const std::vector<int64_t>& prompt) {
  (void)prompt;
  draft_.reset();
}

Proposal SerialDraft::propose(const std::vector<int64_t>& committed, int gamma) {
  try {
    rollout::Rollout rollout = rollout::fresh(draft_, committed, gamma, 0);
    return Proposal{std::move(rollout.tokens), false, rollout.forwards};
  } catch (const Error& e) {  // as in mirror: a draft failure is a draft-worker error, which the fallback handles
    throw Error(Code::DraftWorker, "The draft model failed", e.what(),
                "see the message; the target itself is unaffected");
  }
}

}  // namespace mirrorsd
