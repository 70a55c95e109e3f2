// The kernel object ONNX Runtime holds per GroupedAttention or InPlaceAttention node (attention.cpp says what they
// compute).
#pragma once

#include <string>
#include <utility>

#include "onnxruntime_c_api.h"

namespace mirrorsd_kern {

class Attention {
 public:
  // Reads and checks the node's attributes; an error status on any problem.
  // in_place: the InPlaceAttention form (the cache in the host's views, no presents).
  static OrtStatus* create(const OrtApi* api, const OrtKernelInfo* info, bool in_place, Attention** out);
  OrtStatus* compute(OrtKernelContext* context) const;

 private:
  Attention(const OrtApi* api, std::string node, bool in_place)
      : api_(api), node_(std::move(node)), in_place_(in_place) {}
  OrtStatus* error(OrtErrorCode code, const std::string& what, const std::string& fix) const;

  const OrtApi* api_;
  std::string node_;
  bool in_place_ = false;
  int64_t heads_ = 0;
  int64_t kv_heads_ = 0;
  float scale_ = 0.0f;
};

// What float_op builds for each op name: the same kernel, with or without its cache in place.
struct GroupedAttentionOp {
  using Kernel = Attention;
  static OrtStatus* create(const OrtApi* api, const OrtKernelInfo* info, Attention** out) {
    return Attention::create(api, info, false, out);
  }
};
struct InPlaceAttentionOp {
  using Kernel = Attention;
  static OrtStatus* create(const OrtApi* api, const OrtKernelInfo* info, Attention** out) {
    return Attention::create(api, info, true, out);
  }
};

}  // namespace mirrorsd_kern
