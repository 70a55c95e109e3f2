#include "kv_cache.hpp"

#include <algorithm>
#include <cstring>

#include "errors.hpp"

namespace mirrorsd {

constexpr size_t kMinFloats = 64;  // never hand ONNX Runtime a null buffer

void KVCache::Buffer::ensure(size_t floats, size_t keep) {
  if (floats <= capacity && data) return;
  const size_t grown = std::max({floats, 2 * capacity, kMinFloats});
  std::unique_ptr<float[]> fresh(new float[grown]);
  if (keep) std::memcpy(fresh.get(), data.get(), keep * sizeof(float));
  data = std::move(fresh);
  capacity = grown;
}

KVCache::KVCache(const KVSpec& spec, int64_t batch) : spec_(spec), batch_(batch) {
  current_.resize(spec.past_names.size());
  spare_.resize(spec.past_names.size());
  for (auto& b : current_) b.ensure(kMinFloats, 0);
}

void KVCache::add_past(std::vector<Value>& owned, std::vector<OrtValue*>& inputs) {
  const std::vector<int64_t> shape{batch_, spec_.num_kv_heads, length_, spec_.head_dim};
  for (auto& buffer : current_) {
    owned.push_back(float_tensor(buffer.data.get(), shape));
    inputs.push_back(owned.back().get());
  }
}

void KVCache::add_presents(int64_t new_slots, std::vector<Value>& owned, std::vector<OrtValue*>& outputs) {
  const int64_t total = length_ + new_slots;
  const std::vector<int64_t> shape{batch_, spec_.num_kv_heads, total, spec_.head_dim};
  for (auto& buffer : spare_) {
    buffer.ensure(static_cast<size_t>(batch_ * total * block()), 0);  // fully written by the graph
    owned.push_back(float_tensor(buffer.data.get(), shape));
    outputs.push_back(owned.back().get());
  }
}

void KVCache::commit(int64_t new_slots) {
  std::swap(current_, spare_);
  length_ += new_slots;
}

void KVCache::truncate(int64_t length) {
  if (length < 0 || length > length_)
    throw Error(Code::Internal, "Cannot truncate a cache of " + std::to_string(length_) + " slots to " +
                                    std::to_string(length));
  if (length == length_) return;
  const int64_t d = spec_.head_dim, blocks = batch_ * spec_.num_kv_heads;
  for (auto& buffer : current_) {
    float* data = buffer.data.get();
    for (int64_t b = 1; b < blocks; ++b)  // block 0 is in place; each later block moves down (never overlapping up)
      std::memmove(data + b * length * d, data + b * length_ * d, sizeof(float) * length * d);
  }
  length_ = length;
}

KVCache KVCache::tiled(int64_t rows, int64_t extra) const {
  KVCache out(spec_, rows);
  const size_t row_floats = static_cast<size_t>(length_ * block());
  for (size_t i = 0; i < current_.size(); ++i) {
    out.current_[i].ensure(rows * row_floats, 0);
    out.spare_[i].ensure(static_cast<size_t>(rows * (length_ + extra) * block()), 0);
    for (int64_t r = 0; r < rows; ++r)  // row 0's [h, length, D] block, rows times
      std::memcpy(out.current_[i].data.get() + r * row_floats, current_[i].data.get(), row_floats * sizeof(float));
  }
  out.length_ = length_;
  return out;
}

void KVCache::adopt_slots(const KVCache& other, int64_t row, const std::vector<int64_t>& slots, int64_t dst_start) {
  if (batch_ != 1 || row < 0 || row >= other.batch_ || dst_start < 0 || dst_start > length_)
    throw Error(Code::Internal, "Bad branch adoption (row " + std::to_string(row) + ", at " +
                                    std::to_string(dst_start) + ")");
  const int64_t d = spec_.head_dim, heads = spec_.num_kv_heads, count = static_cast<int64_t>(slots.size());
  const int64_t total = dst_start + count, src_len = other.length_;
  for (int64_t s : slots)
    if (s < 0 || s >= src_len) throw Error(Code::Internal, "Adopted slot " + std::to_string(s) + " out of range");
  for (size_t i = 0; i < current_.size(); ++i) {
    spare_[i].ensure(static_cast<size_t>(heads * total * d), 0);
    float* dst = spare_[i].data.get();
    const float* own = current_[i].data.get();
    const float* src = other.current_[i].data.get() + row * heads * src_len * d;
    for (int64_t h = 0; h < heads; ++h) {
      std::memcpy(dst + h * total * d, own + h * length_ * d, sizeof(float) * dst_start * d);
      for (int64_t j = 0; j < count; ++j)
        std::memcpy(dst + (h * total + dst_start + j) * d, src + (h * src_len + slots[j]) * d, sizeof(float) * d);
    }
  }
  std::swap(current_, spare_);
  length_ = total;
}

}  // namespace mirrorsd
