#include "decoder.hpp"

#include <algorithm>

#include "errors.hpp"
#include "ort.hpp"

namespace mirrorsd {
namespace {

class Decoding {
 public:
  Decoding(const DecodeSettings& settings, const Emit& emit, DecodeOutcome& outcome, std::vector<int64_t>& committed)
      : s_(settings), emit_(emit), out_(outcome), committed_(committed) {}

  // Append accepted tokens, stopping at EOS, the token budget or the callback; true when generation is over.
  bool commit(const std::vector<int64_t>& fresh) {
    const size_t room = static_cast<size_t>(s_.max_new_tokens) - out_.tokens.size();
    for (size_t i = 0; i < fresh.size() && i < room; ++i) {
      const int64_t token = fresh[i];
      committed_.push_back(token);
      out_.tokens.push_back(token);
      const bool eos = std::find(s_.eos_token_ids.begin(), s_.eos_token_ids.end(), token) != s_.eos_token_ids.end();
      if (!emit_(token)) return stop(Finish::Callback);
      if (eos) return stop(Finish::Eos);
    }
    if (static_cast<int64_t>(out_.tokens.size()) >= s_.max_new_tokens) return stop(Finish::Length);
    if (static_cast<int64_t>(committed_.size()) >= s_.context_limit) return stop(Finish::Context);
    return false;
  }

  // Window size for the next step: gamma, fewer near the token budget or the context limit.
  int room() const {
    const int64_t budget = s_.max_new_tokens - static_cast<int64_t>(out_.tokens.size()) - 1;
    const int64_t context = s_.context_limit - static_cast<int64_t>(committed_.size());
    return static_cast<int>(std::max<int64_t>(0, std::min<int64_t>({s_.gamma, budget, context})));
  }

 private:
  bool stop(Finish why) {
    out_.finish = why;
    return true;
  }
  const DecodeSettings& s_;
  const Emit& emit_;
  DecodeOutcome& out_;
  std::vector<int64_t>& committed_;
};

// A failing draft either propagates or, when asked, is replaced by target-only decoding for the rest of the run.
Proposal propose(Proposer*& proposer, Proposer& target_only, const std::vector<int64_t>& committed, int gamma,
                 const DecodeSettings& settings, StepCounters& counters) {
  if (gamma == 0) return target_only.propose(committed, 0);
  try {
    return proposer->propose(committed, gamma);
  } catch (const Error& e) {
    if (e.code() != Code::DraftWorker || settings.on_draft_failure != settings::OnDraftFailure::Fallback) throw;
    ++counters.draft_failures;
    try {
      proposer->finish(1.0);
    } catch (const Error&) {
      // a hung draft call: its thread exits when the call returns (it finds Stop); we go on without it
    }
    proposer = &target_only;
    return target_only.propose(committed, gamma);
  }
}

std::vector<int64_t> argmaxes(const Rows& logits) {
  std::vector<int64_t> out(static_cast<size_t>(logits.rows));
  for (int64_t i = 0; i < logits.rows; ++i) out[i] = argmax(logits.row(i), logits.width);
  return out;
}

// Stops the proposer's worker however decoding ends; an error while unwinding must not replace the first one.
struct FinishGuard {
  Proposer* proposer;
  ~FinishGuard() {
    try {
      proposer->finish();
    } catch (...) {
    }
  }
};

}  // namespace

DecodeOutcome decode(TargetModel& target, Proposer& first_proposer, const std::vector<int64_t>& prompt,
                     const DecodeSettings& settings, const Emit& emit) {
  const double started = now_seconds();
  DecodeOutcome out;
  target.reset();
  Proposer target_only;
  Proposer* proposer = &first_proposer;
  proposer->reset(prompt);
  FinishGuard guard{&first_proposer};  // from here on the proposer may run a worker thread
  std::vector<int64_t> committed = prompt;
  Decoding loop(settings, emit, out, committed);
  Rows logits = target.prefill(prompt);
  const int64_t first = argmax(logits.row(logits.rows - 1), logits.width);
  out.time_to_first_token_s = now_seconds() - started;
  bool done = loop.commit({first});
  int gamma = loop.room();
  while (!done) {
    Proposal proposal = propose(proposer, target_only, committed, gamma, settings, out.counters);
    std::vector<int64_t> window(proposal.tokens.begin(),
                                proposal.tokens.begin() + std::min<size_t>(gamma, proposal.tokens.size()));
    std::vector<int64_t> feed{committed.back()};
    feed.insert(feed.end(), window.begin(), window.end());
    logits = target.extend(feed, gamma ? proposer->exit_callback() : nullptr);  // [g + 1, vocab]
    const Verdict verdict = verify_greedy(window, argmaxes(logits));
    out.counters.record(static_cast<int64_t>(window.size()), verdict.accepted, gamma ? int(proposal.reused) : -1,
                        proposal.draft_forwards);
    std::vector<int64_t> fresh(window.begin(), window.begin() + verdict.accepted);
    fresh.push_back(verdict.correction);
    done = loop.commit(fresh);
    target.truncate(static_cast<int64_t>(committed.size()) - 1);
    gamma = done ? 0 : loop.room();
    if (gamma > 0) proposer->observe(verdict, fresh, gamma);
    else proposer->finish();
  }
  first_proposer.finish();
  out.seconds = now_seconds() - started;
  return out;
}

}  // namespace mirrorsd
