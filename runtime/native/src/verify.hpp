// Verification and branch selection: pure functions, no sessions, no threads (runtime/verify.py, greedy part).
//
// Glossary
//   window      the draft's proposal w1..wg (g = gamma tokens) after the last committed token
//   target      the target's own greedy tokens y0..yg: y_i follows committed + w1..wi
//   accepted    A = the longest prefix of the window that equals the target's tokens (0..g)
//   correction  c = y_A: the target's token where the window first differs
//   bonus       the correction when the whole window was accepted (A = g)
//   branch      (depth d, token v): "the target accepts w1..w(d-1), then its token at d is v"; Mirror-SD rolls out
//               the draft's next window for likely branches; the verdict (A, c) hits branch (A + 1, c)
#pragma once

#include <cstddef>
#include <cstdint>
#include <set>
#include <utility>
#include <vector>

namespace mirrorsd {

// logits row [vocab] -> the first index of the maximum (like numpy.argmax and torch.argmax on exact ties).
int64_t argmax(const float* row, int64_t vocab);

struct Verdict {
  int accepted = 0;
  int64_t correction = 0;
  int drafted = 0;
  bool bonus() const { return accepted == drafted; }
  std::pair<int, int64_t> branch() const { return {accepted + 1, correction}; }
};

// window [g], target_tokens [g + 1] -> Verdict(A, c).
Verdict verify_greedy(const std::vector<int64_t>& window, const std::vector<int64_t>& target_tokens);

// logits rows [rows, vocab] -> ids and log-probs [rows, k], best first (log_softmax over the whole row).
void top_k_logprobs(const float* logits, int64_t rows, int64_t vocab, int64_t k, int64_t* ids, float* logprobs);

struct Branch {
  int depth = 0;  // 1..g+1
  int64_t token = 0;
  double score = 0;  // estimated probability that the verdict is exactly (depth, token)
};

// A source of candidate tokens per window position: ids and log-probs [g + 1, k] (row g = after the window).
struct Candidates {
  const int64_t* ids = nullptr;
  const float* logprobs = nullptr;
  int64_t k = 0;
};

// Candidate branches ranked best first, as rank_branches in runtime/verify.py (read the formula there):
//   q_d(v) = mean over the sources of their probability of v at d (0 where a source does not list v)
//   d <= g:  score = a^(d-1) (1 - a) q_d(v) / (1 - q_d(w_d)),  v != w_d;   d = g + 1:  score = a^g q_d(v)
std::vector<Branch> rank_branches(const std::vector<int64_t>& window, const Candidates& draft, const Candidates* exit,
                                  double accept_rate, const std::set<std::pair<int, int64_t>>& exclude, size_t limit);

}  // namespace mirrorsd
