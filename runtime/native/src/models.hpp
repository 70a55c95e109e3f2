// The target (prefix -> exit head -> suffix) and the draft, each driving its graphs and KV caches
// (runtime/models.py). Position ids are logical positions; attention masks cover every cache slot plus the new tokens,
// and may hold holes (0) anywhere: slots of branches not taken.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "kv_cache.hpp"
#include "ort.hpp"

namespace mirrorsd {

// A graph's float output [rows, width] (batch and sequence flattened), kept in the value ONNX Runtime allocated.
struct Rows {
  Value value;
  const float* data = nullptr;
  int64_t rows = 0, width = 0;
  const float* row(int64_t i) const { return data + i * width; }
};

// The early-exit message: topk ids and log-probs [positions, k] of batch row 0.
using ExitCallback = std::function<void(const int64_t* ids, const float* logprobs, int64_t positions, int64_t k)>;

// Prompt tokens per forward when a prompt is read, in both models: runtime/models.py's PREFILL_CHUNK (the same
// number, so both hosts run the same forwards). A whole long prompt in one forward would ask for its attention
// scores [heads, S, S] and logits [S, vocab] at once.
constexpr int64_t kPrefillChunk = 256;

class TargetModel {
 public:
  TargetModel(GraphSession& prefix, GraphSession& exit_head, GraphSession& suffix, int64_t vocab);
  int64_t length() const { return prefix_cache_.length(); }
  void reset();
  void truncate(int64_t length);
  // One unpadded row: feed `tokens` after the cached ones; logits [S, vocab]. With `on_exit` the exit head runs on
  // the prefix's hidden states before the suffix starts and hands its top-k over at once (Mirror-SD's message).
  Rows extend(const std::vector<int64_t>& tokens, const ExitCallback* on_exit);
  // A prompt: extend by kPrefillChunk tokens at a time; the last chunk's logits [<= kPrefillChunk, vocab].
  Rows prefill(const std::vector<int64_t>& tokens);

 private:
  GraphSession &prefix_, &exit_head_, &suffix_;
  int64_t vocab_;
  KVCache prefix_cache_, suffix_cache_;
};

class DraftModel {
 public:
  DraftModel(GraphSession& session, int64_t vocab);
  void reset();
  KVCache& cache() { return cache_; }
  std::vector<int64_t>& cache_tokens() { return cache_tokens_; }  // the tokens whose KV fills [0, length)

  // ids [B, S], mask [B, cache.length() + S], positions [B, S] -> logits [B * S, vocab]; appends S slots to `cache`.
  Rows forward(KVCache& cache, std::vector<int64_t>& ids, int64_t batch, std::vector<int64_t>& mask,
               std::vector<int64_t>& positions);
  // Roll the main cache back to its longest prefix that is still committed; return the tokens to feed.
  std::vector<int64_t> sync_to(const std::vector<int64_t>& committed);
  // Feed `tokens` to the main cache; logits [S, vocab].
  Rows extend(const std::vector<int64_t>& tokens);
  // A prompt: feed `tokens` to the main cache kPrefillChunk at a time, dropping their logits.
  void prefill(const std::vector<int64_t>& tokens);

 private:
  GraphSession& session_;
  int64_t vocab_;
  KVCache cache_;
  std::vector<int64_t> cache_tokens_;
  size_t agreed_ = 0;  // cache_tokens_[:agreed_] is known to be committed (committed text never changes)
};

}  // namespace mirrorsd
