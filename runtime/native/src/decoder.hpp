// The decode skeleton shared by every strategy: propose -> verify -> commit -> roll back (runtime/decoder.py).
//
//   prefill:  target(prompt) -> first token c0           (cache: prompt; c0 pending)
//   step:     window = proposer.propose(committed, g)    (g = 0 for ar)
//             logits = target([last] + window)           (the exit head hands its top-k to the proposer on the way)
//             verdict = verify_greedy(window, argmax)    (A accepted, correction c)
//             commit window[:A] + [c]; target cache keeps committed[:-1]; proposer.observe(verdict)
// Invariant: the target cache holds KV for every committed token but the last one.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "models.hpp"
#include "proposers.hpp"
#include "settings.hpp"
#include "stats.hpp"

namespace mirrorsd {

enum class Finish { Length = 0, Eos = 1, Context = 2, Callback = 3 };

struct DecodeSettings {
  int64_t max_new_tokens = 128;
  std::vector<int64_t> eos_token_ids;
  int64_t context_limit = 0;
  int gamma = 0;
  settings::OnDraftFailure on_draft_failure = settings::kOnDraftFailure;  // Fallback: continue target-only when the
                                                                          // draft fails (counted in statistics)
};

struct DecodeOutcome {
  std::vector<int64_t> tokens;
  StepCounters counters;
  double seconds = 0, time_to_first_token_s = 0;
  Finish finish = Finish::Length;
};

// Receives each committed token in order; returns false to stop generation after it.
using Emit = std::function<bool(int64_t token)>;

DecodeOutcome decode(TargetModel& target, Proposer& proposer, const std::vector<int64_t>& prompt,
                     const DecodeSettings& settings, const Emit& emit);

}  // namespace mirrorsd
