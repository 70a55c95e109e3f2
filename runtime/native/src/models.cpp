#include "models.hpp"

#include <algorithm>
#include <numeric>

#include "errors.hpp"

namespace mirrorsd {
namespace {

// One call of a graph with a KV cache: [first, mask, positions, past...] -> [main, presents...]; returns main.
Value run_cached(GraphSession& graph, OrtValue* first, OrtValue* mask, OrtValue* positions, KVCache& cache,
                 int64_t new_slots) {
  std::vector<Value> owned;
  std::vector<OrtValue*> inputs{first, mask, positions};
  cache.add_past(owned, inputs);
  std::vector<OrtValue*> outputs{nullptr};
  cache.add_presents(new_slots, owned, outputs);
  graph.run(inputs, outputs);
  Value main(outputs[0]);
  cache.commit(new_slots);
  return main;
}

// The main output as [rows, width], checked against the expected row count and width.
Rows flat(Value value, int64_t rows, int64_t width, const std::string& what) {
  const std::vector<int64_t> shape = shape_of(value.get());
  const int64_t elements = std::accumulate(shape.begin(), shape.end(), int64_t{1}, std::multiplies<int64_t>());
  if (shape.size() != 3 || shape.back() != width || elements != rows * width)
    throw Error(Code::Runtime, "Graph " + what + " returned a tensor of an unexpected shape",
                "expected " + std::to_string(rows) + " rows of " + std::to_string(width),
                "re-export the folder; the graph and mirrorsd.json may not belong together");
  Rows out;
  out.data = float_data(value.get());
  out.value = std::move(value);
  out.rows = rows;
  out.width = width;
  return out;
}

struct SingleRow {
  std::vector<int64_t> ids, mask, positions;
  SingleRow(const std::vector<int64_t>& tokens, int64_t past)
      : ids(tokens), mask(past + tokens.size(), 1), positions(tokens.size()) {
    std::iota(positions.begin(), positions.end(), past);
  }
};

}  // namespace

TargetModel::TargetModel(GraphSession& prefix, GraphSession& exit_head, GraphSession& suffix, int64_t vocab)
    : prefix_(prefix), exit_head_(exit_head), suffix_(suffix), vocab_(vocab) {
  reset();
}

void TargetModel::reset() {
  prefix_cache_ = KVCache(prefix_.spec().kv, 1);
  suffix_cache_ = KVCache(suffix_.spec().kv, 1);
}

void TargetModel::truncate(int64_t length) {
  prefix_cache_.truncate(length);
  suffix_cache_.truncate(length);
}

Rows TargetModel::extend(const std::vector<int64_t>& tokens, const ExitCallback* on_exit) {
  const int64_t s = static_cast<int64_t>(tokens.size());
  SingleRow in(tokens, length());
  Value ids = int64_tensor(in.ids.data(), {1, s});
  Value mask = int64_tensor(in.mask.data(), {1, static_cast<int64_t>(in.mask.size())});
  Value positions = int64_tensor(in.positions.data(), {1, s});
  Value hidden = run_cached(prefix_, ids.get(), mask.get(), positions.get(), prefix_cache_, s);  // [1, S, H]
  if (on_exit != nullptr) {
    std::vector<OrtValue*> inputs{hidden.get()}, outputs{nullptr, nullptr};
    exit_head_.run(inputs, outputs);
    Value top_ids(outputs[0]), top_logprobs(outputs[1]);
    const std::vector<int64_t> shape = shape_of(top_ids.get());  // [1, S, k]
    if (shape.size() != 3 || shape[1] != s || shape_of(top_logprobs.get()) != shape)
      throw Error(Code::Runtime, "The exit head returned top-k tensors of an unexpected shape", "",
                  "re-export the folder");
    (*on_exit)(int64_data(top_ids.get()), float_data(top_logprobs.get()), s, shape[2]);
  }
  Value logits = run_cached(suffix_, hidden.get(), mask.get(), positions.get(), suffix_cache_, s);
  return flat(std::move(logits), s, vocab_, "'suffix'");
}

Rows TargetModel::prefill(const std::vector<int64_t>& tokens) {
  if (tokens.empty()) throw Error(Code::InvalidArgument, "prefill needs at least one token", "", "pass the prompt");
  Rows logits;
  for (size_t start = 0; start < tokens.size(); start += kPrefillChunk) {
    const size_t end = std::min(tokens.size(), start + static_cast<size_t>(kPrefillChunk));
    logits = extend(std::vector<int64_t>(tokens.begin() + start, tokens.begin() + end), nullptr);
  }
  return logits;
}

DraftModel::DraftModel(GraphSession& session, int64_t vocab) : session_(session), vocab_(vocab) { reset(); }

void DraftModel::reset() {
  cache_ = KVCache(session_.spec().kv, 1);
  cache_tokens_.clear();
  agreed_ = 0;
}

Rows DraftModel::forward(KVCache& cache, std::vector<int64_t>& ids, int64_t batch, std::vector<int64_t>& mask,
                         std::vector<int64_t>& positions) {
  const int64_t s = static_cast<int64_t>(ids.size()) / batch;
  Value id_tensor = int64_tensor(ids.data(), {batch, s});
  Value mask_tensor = int64_tensor(mask.data(), {batch, static_cast<int64_t>(mask.size()) / batch});
  Value position_tensor = int64_tensor(positions.data(), {batch, s});
  Value logits = run_cached(session_, id_tensor.get(), mask_tensor.get(), position_tensor.get(), cache, s);
  return flat(std::move(logits), batch * s, vocab_, "'draft'");
}

std::vector<int64_t> DraftModel::sync_to(const std::vector<int64_t>& committed) {
  size_t keep = std::min({agreed_, cache_tokens_.size(), committed.size()});
  while (keep < cache_tokens_.size() && keep < committed.size() && cache_tokens_[keep] == committed[keep]) ++keep;
  agreed_ = keep;
  cache_.truncate(static_cast<int64_t>(keep));
  cache_tokens_.resize(keep);
  return std::vector<int64_t>(committed.begin() + static_cast<std::ptrdiff_t>(keep), committed.end());
}

void DraftModel::prefill(const std::vector<int64_t>& tokens) {
  for (size_t start = 0; start < tokens.size(); start += kPrefillChunk) {
    const size_t end = std::min(tokens.size(), start + static_cast<size_t>(kPrefillChunk));
    extend(std::vector<int64_t>(tokens.begin() + start, tokens.begin() + end));
  }
}

Rows DraftModel::extend(const std::vector<int64_t>& tokens) {
  SingleRow in(tokens, cache_.length());
  Rows logits = forward(cache_, in.ids, 1, in.mask, in.positions);
  cache_tokens_.insert(cache_tokens_.end(), tokens.begin(), tokens.end());
  return logits;
}

}  // namespace mirrorsd
