// Statistics of one generation, with the ecosystem's names (runtime/stats.py; SpecBench's mean accepted tokens).
#pragma once

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

namespace mirrorsd {

struct StepCounters {
  int64_t steps = 0;  // target verification passes after the prefill
  int64_t drafted = 0, accepted = 0;
  int64_t windows = 0;    // steps that verified a draft window
  int64_t reused = 0;     // windows taken from a pre-computed Mirror-SD branch
  int64_t fallbacks = 0;  // windows drafted after the verdict (SD always; Mirror-SD on a branch miss)
  int64_t draft_forwards = 0, branches_rolled_out = 0, draft_failures = 0;

  // reused: -1 for a step without a window (ar), else 0 or 1.
  void record(int64_t window, int64_t accepted_tokens, int reused_window, int64_t forwards) {
    ++steps;
    drafted += window;
    accepted += accepted_tokens;
    if (reused_window >= 0) {
      ++windows;
      reused += reused_window;
      fallbacks += 1 - reused_window;
    }
    draft_forwards += forwards;
  }
};

// Total time covered by both interval lists (each list's intervals do not overlap each other).
inline double overlap_seconds(std::vector<std::pair<double, double>> a, std::vector<std::pair<double, double>> b) {
  std::sort(a.begin(), a.end());
  std::sort(b.begin(), b.end());
  size_t i = 0, j = 0;
  double total = 0;
  while (i < a.size() && j < b.size()) {
    const double lo = std::max(a[i].first, b[j].first), hi = std::min(a[i].second, b[j].second);
    if (hi > lo) total += hi - lo;
    if (a[i].second < b[j].second) ++i;
    else ++j;
  }
  return total;
}

}  // namespace mirrorsd
