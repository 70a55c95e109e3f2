// The GroupedAttention kernel object ONNX Runtime holds per node (attention.cpp says what it computes).
#pragma once

#include <string>
#include <utility>

#include "onnxruntime_c_api.h"

namespace mirrorsd_kern {

class Attention {
 public:
  // Reads and checks the node's attributes; an error status on any problem.
  static OrtStatus* create(const OrtApi* api, const OrtKernelInfo* info, Attention** out);
  OrtStatus* compute(OrtKernelContext* context) const;

 private:
  Attention(const OrtApi* api, std::string node) : api_(api), node_(std::move(node)) {}
  OrtStatus* error(OrtErrorCode code, const std::string& what, const std::string& fix) const;

  const OrtApi* api_;
  std::string node_;
  int64_t heads_ = 0;
  int64_t kv_heads_ = 0;
  float scale_ = 0.0f;
};

}  // namespace mirrorsd_kern
