// KV cache = buffers + a length (runtime/kv_cache.py). Rolling back a rejected draft is a length change, never a
// re-run.
//
// Each layer and kind keeps two host buffers. `current` holds the cache as the graphs take it, [B, h, length, D]
// contiguous, and is fed as the past without a copy. A call with S new tokens gets the other buffer as a preallocated
// present output, [B, h, length + S, D]: the graph writes past + new there itself (docs/graphs.md), and after the call
// the two buffers swap. Truncation moves each (row, head) block down in place; buffers grow by doubling.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "manifest.hpp"
#include "ort.hpp"

namespace mirrorsd {

class KVCache {
 public:
  KVCache() = default;
  KVCache(const KVSpec& spec, int64_t batch);

  int64_t batch() const { return batch_; }
  int64_t length() const { return length_; }

  // A call's past inputs (key, value per layer, graph order), borrowing the current buffers.
  void add_past(std::vector<Value>& owned, std::vector<OrtValue*>& inputs);
  // A call's preallocated present outputs for `new_slots` more slots; `outputs` already holds the main output slot(s).
  void add_presents(int64_t new_slots, std::vector<Value>& owned, std::vector<OrtValue*>& outputs);
  // After a successful call: the presents become the cache.
  void commit(int64_t new_slots);

  void truncate(int64_t length);
  // A `rows`-row copy of row 0's filled slots, with room for `extra` more (branch rollouts).
  KVCache tiled(int64_t rows, int64_t extra) const;
  // Copy `other`'s `row` at `slots` (in order) into row 0 here, contiguous from `dst_start`; later slots are dropped.
  void adopt_slots(const KVCache& other, int64_t row, const std::vector<int64_t>& slots, int64_t dst_start);

 private:
  struct Buffer {
    std::unique_ptr<float[]> data;
    size_t capacity = 0;
    void ensure(size_t floats, size_t keep);  // grow by doubling, keeping the first `keep` floats
  };
  int64_t block() const { return spec_.num_kv_heads * spec_.head_dim; }  // floats per slot of one row

  KVSpec spec_;
  int64_t batch_ = 1, length_ = 0;
  std::vector<Buffer> current_, spare_;  // 2 per layer: key, value (the manifest's order)
};

}  // namespace mirrorsd
