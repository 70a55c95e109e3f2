#include "verify.hpp"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "errors.hpp"

namespace mirrorsd {

int64_t argmax(const float* row, int64_t vocab) {
  return std::max_element(row, row + vocab) - row;  // the first maximum
}

Verdict verify_greedy(const std::vector<int64_t>& window, const std::vector<int64_t>& target_tokens) {
  const int g = static_cast<int>(window.size());
  if (static_cast<int>(target_tokens.size()) != g + 1)
    throw Error(Code::Internal, "Verification needs " + std::to_string(g + 1) + " target tokens for a window of " +
                                    std::to_string(g));
  int accepted = 0;
  while (accepted < g && window[accepted] == target_tokens[accepted]) ++accepted;
  return Verdict{accepted, target_tokens[accepted], g};
}

void top_k_logprobs(const float* logits, int64_t rows, int64_t vocab, int64_t k, int64_t* ids, float* logprobs) {
  k = std::min(k, vocab);
  std::vector<int64_t> order(static_cast<size_t>(vocab));
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = logits + r * vocab;
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + k, order.end(), [row](int64_t a, int64_t b) {
      return row[a] > row[b] || (row[a] == row[b] && a < b);
    });
    const float peak = row[order[0]];
    double total = 0;
    for (int64_t v = 0; v < vocab; ++v) total += std::exp(static_cast<double>(row[v]) - peak);
    const float log_norm = static_cast<float>(peak + std::log(total));
    for (int64_t j = 0; j < k; ++j) {
      ids[r * k + j] = order[j];
      logprobs[r * k + j] = row[order[j]] - log_norm;
    }
  }
}

std::vector<Branch> rank_branches(const std::vector<int64_t>& window, const Candidates& draft, const Candidates* exit,
                                  double accept_rate, const std::set<std::pair<int, int64_t>>& exclude, size_t limit) {
  const int g = static_cast<int>(window.size());
  const double a = std::min(std::max(accept_rate, 0.0), 1.0);
  std::vector<const Candidates*> sources{&draft};
  if (exit != nullptr) sources.push_back(exit);
  std::vector<Branch> ranked;
  std::vector<std::pair<int64_t, double>> probs;  // token -> q_d(token), in first-seen order
  for (int d = 0; d <= g; ++d) {
    probs.clear();
    for (const Candidates* source : sources) {
      for (int64_t j = 0; j < source->k; ++j) {
        const int64_t token = source->ids[d * source->k + j];
        const double p = static_cast<double>(std::exp(source->logprobs[d * source->k + j])) / sources.size();
        auto it = std::find_if(probs.begin(), probs.end(), [token](const auto& e) { return e.first == token; });
        if (it == probs.end()) probs.emplace_back(token, p);
        else it->second += p;
      }
    }
    double weight = std::pow(a, g);
    int64_t drafted = -1;  // no token is excluded at d = g + 1 (the bonus)
    if (d < g) {
      drafted = window[d];
      double q = 0;
      for (const auto& [token, p] : probs)
        if (token == drafted) q = p;
      weight = std::pow(a, d) * (1.0 - a) / std::max(1.0 - q, 1e-6);
    }
    for (const auto& [token, p] : probs)
      if (token != drafted && !exclude.count({d + 1, token}) && weight * p > 0)
        ranked.push_back(Branch{d + 1, token, weight * p});
  }
  std::sort(ranked.begin(), ranked.end(), [](const Branch& x, const Branch& y) {
    if (x.score != y.score) return x.score > y.score;
    return x.depth != y.depth ? x.depth < y.depth : x.token < y.token;
  });
  if (ranked.size() > limit) ranked.resize(limit);
  return ranked;
}

}  // namespace mirrorsd
