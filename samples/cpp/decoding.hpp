// The decode loop of docs/graphs.md, independent of ONNX Runtime: a GraphRunner runs one graph on host tensors.
//
//   Network = stages run in order (target: prefix -> suffix; draft: one stage). Stage 0 takes input_ids, every later
//   stage takes the previous stage's first output (hidden_states). All stages get the same mask and positions and
//   keep their own KV cache for their global layer range; the last stage's first output is the logits.
//
//   AR:  prefill(prompt) -> token; then one token per step.
//   SD:  draft gamma tokens greedily, verify [last, w1..wg] in one target call, accept the longest matching prefix,
//        commit it plus the target's correction c, roll the target caches back by length.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "manifest.hpp"

namespace mirrorsd {

// A dense host tensor: float32 or int64, row-major.
struct HostTensor {
  std::vector<int64_t> shape;
  std::vector<float> f32;
  std::vector<int64_t> i64;
  bool is_float = true;

  static HostTensor floats(std::vector<int64_t> shape, std::vector<float> data) {
    return HostTensor{std::move(shape), std::move(data), {}, true};
  }
  static HostTensor ints(std::vector<int64_t> shape, std::vector<int64_t> data) {
    return HostTensor{std::move(shape), {}, std::move(data), false};
  }
};

using Feeds = std::vector<std::pair<std::string, const HostTensor*>>;
using Outputs = std::map<std::string, HostTensor>;

class GraphRunner {
 public:
  virtual ~GraphRunner() = default;
  virtual Outputs run(const Feeds& feeds, const std::vector<std::string>& output_names) = 0;
};

// KV of one stage: per layer a [1, heads, length, head_dim] tensor. present = past + new, so after a call the
// present simply replaces the past. Rollback keeps the first n slots of every head (a repack, never a re-run).
class KVCache {
 public:
  explicit KVCache(const KVInfo& info) : info_(info) {
    for (int layer = info.first; layer < info.end; ++layer) {
      past_names_.push_back(KVInfo::fill(info.past_key, layer));
      past_names_.push_back(KVInfo::fill(info.past_value, layer));
      present_names_.push_back(KVInfo::fill(info.present_key, layer));
      present_names_.push_back(KVInfo::fill(info.present_value, layer));
    }
    reset();
  }

  void reset() {
    tensors_.assign(past_names_.size(), HostTensor::floats({1, info_.num_kv_heads, 0, info_.head_dim}, {}));
    length_ = 0;
  }
  int64_t length() const { return length_; }

  void add_feeds(Feeds& feeds) const {
    for (size_t i = 0; i < past_names_.size(); ++i) feeds.emplace_back(past_names_[i], &tensors_[i]);
  }

  void absorb(Outputs& outputs, int64_t new_slots) {
    for (size_t i = 0; i < present_names_.size(); ++i) {
      auto it = outputs.find(present_names_[i]);
      if (it == outputs.end()) throw std::runtime_error("graph did not return " + present_names_[i]);
      const auto& shape = it->second.shape;
      if (shape.size() != 4 || shape[2] != length_ + new_slots)
        throw std::runtime_error(present_names_[i] + " has an unexpected shape (present must be past + new)");
      tensors_[i] = std::move(it->second);
    }
    length_ += new_slots;
  }

  void truncate(int64_t n) {
    if (n < 0 || n > length_) throw std::runtime_error("cannot truncate the KV cache past its length");
    for (auto& t : tensors_) repack(t, n);
    length_ = n;
  }

 private:
  static void repack(HostTensor& t, int64_t n) {
    const int64_t heads = t.shape[1], old_len = t.shape[2], dim = t.shape[3];
    for (int64_t h = 1; h < heads; ++h)  // head 0 is already in place; later heads move down
      std::memmove(&t.f32[h * n * dim], &t.f32[h * old_len * dim], sizeof(float) * n * dim);
    t.f32.resize(heads * n * dim);
    t.shape[2] = n;
  }

  KVInfo info_;
  std::vector<std::string> past_names_, present_names_;  // key, value interleaved per layer
  std::vector<HostTensor> tensors_;                       // [1, heads, length, head_dim] each
  int64_t length_ = 0;
};

struct Stage {
  GraphInfo info;
  std::unique_ptr<GraphRunner> runner;
  KVCache cache;
};

class Network {
 public:
  void add_stage(GraphInfo info, std::unique_ptr<GraphRunner> runner) {
    KVCache cache(info.kv);
    stages_.push_back(Stage{std::move(info), std::move(runner), std::move(cache)});
  }
  void reset() { for (auto& s : stages_) s.cache.reset(); }
  int64_t length() const { return stages_.front().cache.length(); }
  void truncate(int64_t n) { for (auto& s : stages_) s.cache.truncate(n); }
  int64_t calls = 0;

  // Feed `tokens` after the cached ones (one unpadded row); returns logits [tokens.size() x vocab], row-major.
  HostTensor extend(const std::vector<int64_t>& tokens) {
    const int64_t s = static_cast<int64_t>(tokens.size()), past = length();
    HostTensor ids = HostTensor::ints({1, s}, tokens);
    HostTensor mask = HostTensor::ints({1, past + s}, std::vector<int64_t>(past + s, 1));
    std::vector<int64_t> pos(s);
    for (int64_t i = 0; i < s; ++i) pos[i] = past + i;
    HostTensor positions = HostTensor::ints({1, s}, pos);
    HostTensor carried = std::move(ids);
    for (auto& stage : stages_) {
      Feeds feeds{{stage.info.inputs[0], &carried}, {stage.info.inputs[1], &mask}, {stage.info.inputs[2], &positions}};
      stage.cache.add_feeds(feeds);
      Outputs out = stage.runner->run(feeds, stage.info.outputs);
      stage.cache.absorb(out, s);
      carried = std::move(out.at(stage.info.outputs[0]));
    }
    ++calls;
    return carried;
  }

 private:
  std::vector<Stage> stages_;
};

inline int64_t argmax_row(const HostTensor& logits, int64_t row) {
  const int64_t vocab = logits.shape.back();
  const float* p = logits.f32.data() + row * vocab;
  return std::max_element(p, p + vocab) - p;  // first index on exact ties, like numpy and torch
}

struct DecodeSettings {
  int64_t max_new_tokens = 32;
  int gamma = 4;
  std::vector<int64_t> eos_token_ids;
  int64_t context_limit = 1 << 30;
};

struct DecodeResult {
  std::vector<int64_t> tokens;
  int64_t steps = 0, drafted = 0, accepted = 0, target_calls = 0, draft_calls = 0;
  double seconds = 0;
};

// The draft side of SD: its cache holds the KV of `fed` (a prefix of what it drafted on); greedy rollouts.
class GreedyDrafter {
 public:
  explicit GreedyDrafter(Network& draft) : draft_(draft) {}

  void reset() { draft_.reset(); draft_.calls = 0; fed_.clear(); }
  int64_t calls() const { return draft_.calls; }

  std::vector<int64_t> propose(const std::vector<int64_t>& committed, int gamma) {
    size_t keep = 0;
    while (keep < fed_.size() && keep < committed.size() && fed_[keep] == committed[keep]) ++keep;
    if (keep == committed.size()) --keep;  // always feed at least one token to get logits
    draft_.truncate(static_cast<int64_t>(keep));
    fed_.resize(keep);
    std::vector<int64_t> feed(committed.begin() + keep, committed.end()), window;
    for (int i = 0; i < gamma; ++i) {
      HostTensor logits = draft_.extend(feed);
      fed_.insert(fed_.end(), feed.begin(), feed.end());
      window.push_back(argmax_row(logits, logits.shape[1] - 1));
      feed = {window.back()};
    }
    return window;
  }

 private:
  Network& draft_;
  std::vector<int64_t> fed_;
};

// Appends `fresh` to the output, stopping at EOS or the budget; returns true when generation is over.
inline bool commit(const std::vector<int64_t>& fresh, std::vector<int64_t>& committed, DecodeResult& r,
                   const DecodeSettings& s) {
  for (int64_t token : fresh) {
    if (static_cast<int64_t>(r.tokens.size()) >= s.max_new_tokens) return true;
    committed.push_back(token);
    r.tokens.push_back(token);
    if (std::find(s.eos_token_ids.begin(), s.eos_token_ids.end(), token) != s.eos_token_ids.end()) return true;
  }
  return static_cast<int64_t>(r.tokens.size()) >= s.max_new_tokens ||
         static_cast<int64_t>(committed.size()) >= s.context_limit;
}

// Target-only greedy decoding when drafter is null, else vanilla speculative decoding. Same tokens either way.
inline DecodeResult decode(Network& target, GreedyDrafter* drafter, const std::vector<int64_t>& prompt,
                           const DecodeSettings& s) {
  auto start = std::chrono::steady_clock::now();
  DecodeResult r;
  target.reset();
  target.calls = 0;
  if (drafter) drafter->reset();
  std::vector<int64_t> committed = prompt;
  HostTensor logits = target.extend(prompt);
  bool done = commit({argmax_row(logits, logits.shape[1] - 1)}, committed, r, s);
  while (!done) {
    int64_t room = std::min<int64_t>({static_cast<int64_t>(s.gamma), s.max_new_tokens - (int64_t)r.tokens.size() - 1,
                                      s.context_limit - (int64_t)committed.size()});
    int gamma = drafter ? static_cast<int>(std::max<int64_t>(0, room)) : 0;
    std::vector<int64_t> window = gamma ? drafter->propose(committed, gamma) : std::vector<int64_t>{};
    std::vector<int64_t> feed{committed.back()};
    feed.insert(feed.end(), window.begin(), window.end());
    logits = target.extend(feed);  // [1, gamma + 1, vocab]: row i follows committed + w1..wi
    size_t accepted = 0;
    while (accepted < window.size() && window[accepted] == argmax_row(logits, accepted)) ++accepted;
    std::vector<int64_t> fresh(window.begin(), window.begin() + accepted);
    fresh.push_back(argmax_row(logits, accepted));  // the correction (the bonus token when all were accepted)
    ++r.steps;
    r.drafted += window.size();
    r.accepted += accepted;
    done = commit(fresh, committed, r, s);
    target.truncate(static_cast<int64_t>(committed.size()) - 1);  // cache: every committed token but the last
  }
  r.target_calls = target.calls;
  r.draft_calls = drafter ? drafter->calls() : 0;
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return r;
}

}  // namespace mirrorsd
