// The rollout engine (runtime/rollout.py): every draft window of sd and Mirror-SD comes from here.
//   fresh     roll the draft's main cache back to the committed tokens, then draft g tokens greedily (g forwards)
//   branches  roll out several branches of a window together, one row each, in a tiled copy of the main cache
//   adopt     take a rolled-out branch's KV slots and tokens into the main cache: the next window, no forward spent
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "kv_cache.hpp"
#include "models.hpp"
#include "verify.hpp"

namespace mirrorsd::rollout {

struct Rollout {
  std::vector<int64_t> tokens;      // [g]
  std::vector<int64_t> top_ids;     // [g, k] the draft's best tokens at each window position (k may be 0)
  std::vector<float> top_logprobs;  // [g, k]
  int64_t forwards = 0;
};

// The main cache ends holding committed + window[:-1].
Rollout fresh(DraftModel& draft, const std::vector<int64_t>& committed, int gamma, int64_t top_k);

struct Branches {
  std::shared_ptr<KVCache> cache;                  // one row per branch
  std::vector<std::vector<int64_t>> tokens;        // [rows][g] each branch's rollout
  std::vector<std::vector<int64_t>> top_ids;       // [rows][g * k]
  std::vector<std::vector<float>> top_logprobs;    // [rows][g * k]
  std::vector<int64_t> slots;                      // [g] cache slots of each row's fed tokens v, t_1 .. t_g-1
  bool complete = false;                           // false: `after_forward` stopped it early
};

// Row r continues committed + window[:d_r - 1] + v_r, where `base_length` = committed tokens when the window was
// drafted and the main cache holds committed + the whole window's slots (beyond each row's branch point they are
// masked out, so one tiled cache serves every depth). `after_forward` runs after each of the g forwards; true stops.
Branches branches(DraftModel& draft, int64_t base_length, int64_t gamma, const std::vector<Branch>& batch,
                  int64_t top_k, const std::function<bool()>& after_forward);

// Adopt row `row` of `rolled` as the main cache's continuation: keep `keep` tokens (committed + accepted), then the
// correction and the branch's first g - 1 tokens, whose KV the row computed.
void adopt(DraftModel& draft, const Branches& rolled, int64_t row, int64_t keep, int64_t correction, size_t gamma);

}  // namespace mirrorsd::rollout
