// mirrorsd.kern::KVWrite: one KV head's new rows written into the cache the host fed, in place.
//
//   inputs   x     any float tensor, passed through (it orders the node before the attention that reads `view`)
//            new   [B, KVH, S, D]   this call's keys (after rotary) or values, all KV heads
//            view  [B, 1, T, D]     the host's cache of KV head `head`: slots [0, T - S) hold the past, and
//                                   slots [T - S, T) receive new[:, head] here
//   output   y     a copy of x
//   attribute head
//
// Why: an exported layer builds its present keys as Concat(past, new), which reads and writes the whole cache every
// step (at 8k cached tokens most of a decoding step's time on a CPU). devices/kernels/kv_in_place.py rewrites a
// layer so that each KV head's attention reads a `view` input that already spans the past and the new slots, and
// this node fills the new slots before the attention runs (the attention reads y, so it runs after). The values are
// the graph's own (copied, never recomputed); what still differs from the Concat graph is how ONNX Runtime blocks
// one head's attention product (devices/kernels/README.md, "KVWrite").
// Writing into an input is what makes the cache in place: ONNX Runtime hands a CPU input's memory to the kernels
// as the host fed it (the host keeps the buffer alive for the call; runtime/view_cache.py).
#include "kv_write.hpp"

#include "kernel.hpp"

#include <cstring>
#include <memory>
#include <vector>

namespace mirrorsd_kern {

namespace {

#define KV_RETURN_IF(expr)       \
  do {                           \
    OrtStatus* _status = (expr); \
    if (_status) return _status; \
  } while (0)

struct Shaped {
  void* data = nullptr;
  std::vector<int64_t> dims;
  size_t count = 1;
};

OrtStatus* shaped(const OrtApi* api, const OrtValue* value, Shaped& out) {
  OrtTensorTypeAndShapeInfo* info = nullptr;
  KV_RETURN_IF(api->GetTensorTypeAndShape(value, &info));
  size_t rank = 0;
  OrtStatus* status = api->GetDimensionsCount(info, &rank);
  if (!status) {
    out.dims.assign(rank, 0);
    status = api->GetDimensions(info, out.dims.data(), rank);
  }
  api->ReleaseTensorTypeAndShapeInfo(info);
  if (status) return status;
  for (int64_t d : out.dims) out.count *= static_cast<size_t>(d < 0 ? 0 : d);
  return api->GetTensorMutableData(const_cast<OrtValue*>(value), &out.data);
}


}  // namespace

OrtStatus* KVWrite::error(OrtErrorCode code, const std::string& what, const std::string& fix) const {
  const std::string text = "mirrorsd.kern KVWrite node '" + node_ + "': " + what + ". Fix: " + fix + ".";
  return api_->CreateStatus(code, text.c_str());
}

OrtStatus* KVWrite::create(const OrtApi* api, const OrtKernelInfo* info, KVWrite** out) {
  std::unique_ptr<KVWrite> kernel(new KVWrite(api, node_name(api, info)));
  int64_t head = -1;
  if (OrtStatus* s = api->KernelInfoGetAttribute_int64(info, "head", &head)) {
    api->ReleaseStatus(s);
    return kernel->error(ORT_INVALID_ARGUMENT, "the attribute head is required",
                         "rewrite the graph with mirrorsd.devices.kernels.kv_in_place");
  }
  if (head < 0) return kernel->error(ORT_INVALID_ARGUMENT, "head=" + std::to_string(head), "give a head >= 0");
  kernel->head_ = head;
  *out = kernel.release();
  return nullptr;
}

OrtStatus* KVWrite::compute(OrtKernelContext* context) const {
  Shaped in[3];
  for (size_t i = 0; i < 3; ++i) {
    const OrtValue* value = nullptr;
    KV_RETURN_IF(api_->KernelContext_GetInput(context, i, &value));
    if (!value) return error(ORT_INVALID_ARGUMENT, "input " + std::to_string(i) + " is missing", "give all 3");
    KV_RETURN_IF(shaped(api_, value, in[i]));
  }
  const Shaped &x = in[0], &fresh = in[1], &view = in[2];
  const bool ranks = fresh.dims.size() == 4 && view.dims.size() == 4;
  if (!ranks || view.dims[0] != fresh.dims[0] || view.dims[1] != 1 || view.dims[3] != fresh.dims[3] ||
      head_ >= fresh.dims[1] || view.dims[2] < fresh.dims[2])
    return error(ORT_INVALID_ARGUMENT, "new " + shape_text(fresh.dims) + " and view " + shape_text(view.dims) +
                 " do not fit head " + std::to_string(head_),
                 "feed the view as [B, 1, past + new slots, D] (runtime/view_cache.py)");
  OrtValue* output = nullptr;
  KV_RETURN_IF(api_->KernelContext_GetOutput(context, 0, x.dims.data(), x.dims.size(), &output));
  void* y = nullptr;
  KV_RETURN_IF(api_->GetTensorMutableData(output, &y));
  if (x.count) std::memcpy(y, x.data, x.count * sizeof(float));
  const int64_t B = fresh.dims[0], KVH = fresh.dims[1], S = fresh.dims[2], D = fresh.dims[3], T = view.dims[2];
  const size_t row_bytes = static_cast<size_t>(S * D) * sizeof(float);
  const float* src = static_cast<const float*>(fresh.data);
  float* dst = static_cast<float*>(view.data);
  for (int64_t b = 0; b < B && row_bytes; ++b)
    std::memcpy(dst + (b * T + T - S) * D, src + ((b * KVH + head_) * S) * D, row_bytes);
  return nullptr;
}

}  // namespace mirrorsd_kern
