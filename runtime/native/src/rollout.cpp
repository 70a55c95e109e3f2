#include "rollout.hpp"

#include <algorithm>

namespace mirrorsd::rollout {

Rollout fresh(DraftModel& draft, const std::vector<int64_t>& committed, int gamma, int64_t top_k) {
  std::vector<int64_t> feed = draft.sync_to(committed);
  if (feed.empty()) {  // everything is cached (never after a verdict): feed the last committed token again
    draft.sync_to(std::vector<int64_t>(committed.begin(), committed.end() - 1));
    feed = {committed.back()};
  } else if (static_cast<int64_t>(feed.size()) > kPrefillChunk) {  // a prompt: in chunks; its last token drafts
    draft.prefill(std::vector<int64_t>(feed.begin(), feed.end() - 1));
    feed = {feed.back()};
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

Branches branches(DraftModel& draft, int64_t base_length, int64_t gamma, const std::vector<Branch>& batch,
                  int64_t top_k, const std::function<bool()>& after_forward) {
  const int64_t g = gamma, rows = static_cast<int64_t>(batch.size()), k = top_k, base = draft.cache().length();
  Branches out;
  out.cache = std::make_shared<KVCache>(draft.cache().tiled(rows, g));
  std::vector<std::vector<int64_t>> masks(static_cast<size_t>(rows), std::vector<int64_t>(base, 1));
  std::vector<int64_t> ids(static_cast<size_t>(rows)), positions(static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t keep = base_length + batch[r].depth - 1;  // the branch point
    std::fill(masks[r].begin() + keep, masks[r].end(), 0);
    positions[r] = keep;
    ids[r] = batch[r].token;
  }
  out.tokens.resize(rows), out.top_ids.resize(rows), out.top_logprobs.resize(rows);
  std::vector<int64_t> step_ids(k), mask;
  std::vector<float> step_lps(k);
  for (int64_t step = 0; step < g; ++step) {
    mask.clear();
    for (auto& m : masks) {
      m.push_back(1);
      mask.insert(mask.end(), m.begin(), m.end());  // [rows, base + step + 1]
    }
    Rows logits = draft.forward(*out.cache, ids, rows, mask, positions);  // [rows, vocab]
    for (int64_t r = 0; r < rows; ++r) {
      top_k_logprobs(logits.row(r), 1, logits.width, k, step_ids.data(), step_lps.data());
      out.top_ids[r].insert(out.top_ids[r].end(), step_ids.begin(), step_ids.end());
      out.top_logprobs[r].insert(out.top_logprobs[r].end(), step_lps.begin(), step_lps.end());
      ids[r] = argmax(logits.row(r), logits.width);
      out.tokens[r].push_back(ids[r]);
      ++positions[r];
    }
    if (after_forward()) return out;
  }
  out.slots.resize(static_cast<size_t>(g));
  for (int64_t j = 0; j < g; ++j) out.slots[j] = out.cache->length() - g + j;  // one new slot per forward, every row
  out.complete = true;
  return out;
}

void adopt(DraftModel& draft, const Branches& rolled, int64_t row, int64_t keep, int64_t correction, size_t gamma) {
  const std::vector<int64_t>& tokens = rolled.tokens[row];
  draft.cache().adopt_slots(*rolled.cache, row, std::vector<int64_t>(rolled.slots.begin(), rolled.slots.begin() + gamma),
                            keep);
  std::vector<int64_t>& cached = draft.cache_tokens();
  cached.resize(static_cast<size_t>(keep));
  cached.push_back(correction);
  cached.insert(cached.end(), tokens.begin(), tokens.begin() + (gamma - 1));
}

}  // namespace mirrorsd::rollout
