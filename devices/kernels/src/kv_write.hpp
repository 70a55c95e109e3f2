// The KVWrite kernel object ONNX Runtime holds per node (kv_write.cpp says what it does).
#pragma once

#include <string>
#include <utility>

#include "onnxruntime_c_api.h"

namespace mirrorsd_kern {

class KVWrite {
 public:
  static OrtStatus* create(const OrtApi* api, const OrtKernelInfo* info, KVWrite** out);
  OrtStatus* compute(OrtKernelContext* context) const;

 private:
  KVWrite(const OrtApi* api, std::string node) : api_(api), node_(std::move(node)) {}
  OrtStatus* error(OrtErrorCode code, const std::string& what, const std::string& fix) const;

  const OrtApi* api_;
  std::string node_;
  int64_t head_ = 0;
};

}  // namespace mirrorsd_kern
