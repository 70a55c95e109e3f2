#include "proposers.hpp"

#include "errors.hpp"

namespace mirrorsd {

Rollout draft_rollout(DraftModel& draft, const std::vector<int64_t>& committed, int gamma, int64_t top_k) {
  std::vector<int64_t> feed = draft.sync_to(committed);
  if (feed.empty()) {  // everything is cached (never after a verdict): feed the last committed token again
    draft.sync_to(std::vector<int64_t>(committed.begin(), committed.end() - 1));
    feed = {committed.back()};
  }
  Rollout out;
  out.top_ids.resize(static_cast<size_t>(gamma * top_k));
  out.top_logprobs.resize(out.top_ids.size());
  for (int i = 0; i < gamma; ++i) {
    Rows logits = draft.extend(feed);
    const float* last = logits.row(logits.rows - 1);  // [vocab]
    const int64_t token = argmax(last, logits.width);
    if (top_k) top_k_logprobs(last, 1, logits.width, top_k, &out.top_ids[i * top_k], &out.top_logprobs[i * top_k]);
    out.tokens.push_back(token);
    feed = {token};
  }
  out.forwards = gamma;
  return out;
}

void SerialDraft::reset(const std::vector<int64_t>& prompt) {
  (void)prompt;
  draft_.reset();
}

Proposal SerialDraft::propose(const std::vector<int64_t>& committed, int gamma) {
  try {
    Rollout rollout = draft_rollout(draft_, committed, gamma, 0);
    return Proposal{std::move(rollout.tokens), false, rollout.forwards};
  } catch (const Error& e) {  // as in mirror: a draft failure is a draft-worker error, which the fallback handles
    throw Error(Code::DraftWorker, "The draft model failed", e.what(),
                "see the message; the target itself is unaffected");
  }
}

}  // namespace mirrorsd
