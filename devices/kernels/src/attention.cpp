// mirrorsd.kern::GroupedAttention: one decoder layer's attention for decoding, in one node. It replaces the ~30
// small nodes an exported graph spends on it (rotary embedding of q and k, the KV-cache concatenation, the grouped
// scores, mask, softmax and weighted sum, the head reshapes), whose per-node cost dominated a small draft's
// forward once its weights streamed near the bandwidth (devices/kernels/attention_rewrite.py puts it in a graph).
//
//   inputs   q [B, S, H*D]  k, v [B, S, KVH*D]   (projections, bias added, before rotary)
//            cos, sin [B, S, D]                   (the graph's rotary tables: the half-width angles repeated twice)
//            mask [B, 1, S, T]                    additive (0 or a large negative), T = P + S
//            past_k, past_v [B, KVH, P, D]
//   outputs  y [B, S, H*D]   present_k, present_v [B, KVH, T, D]
//   attributes num_heads (H), kv_num_heads (KVH), scale
//
// Query head h reads KV head h / (H / KVH), as transformers' repeat_kv. Rotary is transformers' rotate_half form:
// x * cos + rotate_half(x) * sin. Each query row is computed alone, in one fixed order, whatever S, T or the
// thread count: its result does not depend on the rows around it.
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "attention.hpp"
#include "kernel.hpp"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define MIRRORSD_ATTENTION_AVX2 1
#endif

namespace mirrorsd_kern {

namespace {

enum AttentionInput : size_t { kQ, kK, kV, kCos, kSin, kMask, kPastK, kPastV, kAttentionInputs };
constexpr size_t kAttentionOutputs = 3;
constexpr int64_t kMaxHeadDim = 512;
constexpr int64_t kInlineWork = 64 * 1024;  // multiply-adds below which the calling thread does it all

#define ATTENTION_RETURN_IF(expr) \
  do {                            \
    OrtStatus* _status = (expr);  \
    if (_status) return _status;  \
  } while (0)

struct Tensor {
  float* data = nullptr;
  std::vector<int64_t> dims;
};

OrtStatus* float_tensor(const OrtApi* api, const OrtValue* value, Tensor& out) {
  OrtTensorTypeAndShapeInfo* info = nullptr;
  ATTENTION_RETURN_IF(api->GetTensorTypeAndShape(value, &info));
  size_t rank = 0;
  ONNXTensorElementDataType type = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
  OrtStatus* status = api->GetTensorElementType(info, &type);
  if (!status) status = api->GetDimensionsCount(info, &rank);
  if (!status) {
    out.dims.assign(rank, 0);
    status = api->GetDimensions(info, out.dims.data(), rank);
  }
  api->ReleaseTensorTypeAndShapeInfo(info);
  if (status) return status;
  if (type != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT)
    return api->CreateStatus(ORT_INVALID_ARGUMENT, "mirrorsd.kern GroupedAttention: every input must be float32");
  void* data = nullptr;
  ATTENTION_RETURN_IF(api->GetTensorMutableData(const_cast<OrtValue*>(value), &data));
  out.data = static_cast<float*>(data);
  return nullptr;
}


bool has_dims(const Tensor& t, std::initializer_list<int64_t> want) {
  if (t.dims.size() != want.size()) return false;
  size_t i = 0;
  for (int64_t d : want) {
    if (t.dims[i++] != d) return false;
  }
  return true;
}

// x * cos + rotate_half(x) * sin, rotate_half(x) = [-x[D/2:], x[:D/2]]
void rotate(const float* x, const float* cos, const float* sin, int64_t dim, float* out) {
  const int64_t half = dim / 2;
  for (int64_t i = 0; i < half; ++i) out[i] = x[i] * cos[i] - x[i + half] * sin[i];
  for (int64_t i = half; i < dim; ++i) out[i] = x[i] * cos[i] + x[i - half] * sin[i];
}

struct Job {
  int64_t B, S, H, KVH, D, P, T;
  float scale;
  const float *q, *k, *v, *cos, *sin, *mask, *past_k, *past_v;
  float *y, *present_k, *present_v;
};

// Task (b, kvh): the past copied into the present, then the new rows (k rotated).
void append_task(void* data, size_t task) {
  const Job& j = *static_cast<const Job*>(data);
  const int64_t b = static_cast<int64_t>(task) / j.KVH, kvh = static_cast<int64_t>(task) % j.KVH;
  const size_t past_floats = static_cast<size_t>(j.P * j.D);
  float* pk = j.present_k + (b * j.KVH + kvh) * j.T * j.D;
  float* pv = j.present_v + (b * j.KVH + kvh) * j.T * j.D;
  if (past_floats) {
    std::memcpy(pk, j.past_k + (b * j.KVH + kvh) * past_floats, past_floats * sizeof(float));
    std::memcpy(pv, j.past_v + (b * j.KVH + kvh) * past_floats, past_floats * sizeof(float));
  }
  for (int64_t s = 0; s < j.S; ++s) {
    const int64_t row = (b * j.S + s) * j.KVH * j.D + kvh * j.D;
    const int64_t angle = (b * j.S + s) * j.D;
    rotate(j.k + row, j.cos + angle, j.sin + angle, j.D, pk + (j.P + s) * j.D);
    std::memcpy(pv + (j.P + s) * j.D, j.v + row, static_cast<size_t>(j.D) * sizeof(float));
  }
}

// Eight independent partial sums, added in one fixed order at the end (vectorizes without reassociation).
float dot(const float* a, const float* b, int64_t n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int lane = 0; lane < 8; ++lane) acc[lane] += a[i + lane] * b[i + lane];
  }
  float sum = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

#ifdef MIRRORSD_ATTENTION_AVX2
// exp(x) for x <= 0 (softmax arguments), 8 at a time: 2^n * p(r) with x = n ln2 + r, |r| <= ln2 / 2, p a degree-6
// polynomial (relative error ~2e-7); below -87 the result is 0, as exp's is in float32 after rounding.
__attribute__((target("avx2,fma"))) __m256 exp_avx2(__m256 x) {
  const __m256 low = _mm256_set1_ps(-87.0f);
  const __m256 zero_mask = _mm256_cmp_ps(x, low, _CMP_LT_OQ);
  x = _mm256_max_ps(x, low);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(zero_mask, _mm256_mul_ps(p, _mm256_castsi256_ps(bits)));
}

__attribute__((target("avx2,fma"))) float sum_avx2(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}

__attribute__((target("avx2,fma"))) inline __m256 dot8(const float* a, const float* b, int64_t dim) {
  __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(a), _mm256_loadu_ps(b));
  for (int64_t d = 8; d < dim; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), acc);
  return acc;
}

// out[0, CHUNKS * 8) = sum over slots of weights[u] * values[u]: the accumulators stay in registers, slots outer.
template <int CHUNKS>
__attribute__((target("avx2,fma"))) void weighted_sum_avx2(const float* weights, const float* values, int64_t slots,
                                                           float scale, float* out) {
  __m256 acc[CHUNKS];
  for (int c = 0; c < CHUNKS; ++c) acc[c] = _mm256_setzero_ps();
  for (int64_t u = 0; u < slots; ++u) {
    const __m256 w = _mm256_set1_ps(weights[u]);
    const float* value = values + u * CHUNKS * 8;
    for (int c = 0; c < CHUNKS; ++c) acc[c] = _mm256_fmadd_ps(w, _mm256_loadu_ps(value + c * 8), acc[c]);
  }
  for (int c = 0; c < CHUNKS; ++c) _mm256_storeu_ps(out + c * 8, _mm256_mul_ps(acc[c], _mm256_set1_ps(scale)));
}

// One query row (D a multiple of 8): scores, softmax and the weighted sum of values, 8 lanes at a time.
__attribute__((target("avx2,fma"))) void attend_avx2(const float* query, const float* keys, const float* values,
                                                     const float* mask, int64_t slots, int64_t dim, float scale,
                                                     float* weights, float* out) {
  float top = -INFINITY;
  int64_t t = 0;
  for (; t + 4 <= slots; t += 4) {  // four slots at a time: four independent chains
    const float* key = keys + t * dim;
    const __m256 a = dot8(query, key, dim), b = dot8(query, key + dim, dim);
    const __m256 c = dot8(query, key + 2 * dim, dim), d = dot8(query, key + 3 * dim, dim);
    weights[t] = sum_avx2(a) * scale + mask[t];
    weights[t + 1] = sum_avx2(b) * scale + mask[t + 1];
    weights[t + 2] = sum_avx2(c) * scale + mask[t + 2];
    weights[t + 3] = sum_avx2(d) * scale + mask[t + 3];
  }
  for (; t < slots; ++t) weights[t] = sum_avx2(dot8(query, keys + t * dim, dim)) * scale + mask[t];
  for (t = 0; t < slots; ++t) top = weights[t] > top ? weights[t] : top;
  const __m256 shift = _mm256_set1_ps(top);
  __m256 total8 = _mm256_setzero_ps();
  for (t = 0; t + 8 <= slots; t += 8) {
    const __m256 w = exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(weights + t), shift));
    _mm256_storeu_ps(weights + t, w);
    total8 = _mm256_add_ps(total8, w);
  }
  float total = sum_avx2(total8);
  for (; t < slots; ++t) {
    weights[t] = std::exp(weights[t] - top);
    total += weights[t];
  }
  const float inverse = 1.0f / total;
  if (dim == 64) return weighted_sum_avx2<8>(weights, values, slots, inverse, out);
  if (dim == 128) return weighted_sum_avx2<16>(weights, values, slots, inverse, out);
  for (int64_t d = 0; d < dim; d += 8) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t u = 0; u < slots; ++u)
      acc = _mm256_fmadd_ps(_mm256_set1_ps(weights[u]), _mm256_loadu_ps(values + u * dim + d), acc);
    _mm256_storeu_ps(out + d, _mm256_mul_ps(acc, _mm256_set1_ps(inverse)));
  }
}

const bool kHasAvx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#endif

// Task (b, h, s): one query row against every slot of its KV head.
void row_task(void* data, size_t task) {
  const Job& j = *static_cast<const Job*>(data);
  const int64_t s = static_cast<int64_t>(task) % j.S;
  const int64_t h = static_cast<int64_t>(task) / j.S % j.H;
  const int64_t b = static_cast<int64_t>(task) / (j.S * j.H);
  const int64_t kvh = h / (j.H / j.KVH);
  float query[kMaxHeadDim];
  const int64_t angle = (b * j.S + s) * j.D;
  rotate(j.q + (b * j.S + s) * j.H * j.D + h * j.D, j.cos + angle, j.sin + angle, j.D, query);
  thread_local std::vector<float> weights;
  weights.resize(static_cast<size_t>(j.T));
  const float* keys = j.present_k + (b * j.KVH + kvh) * j.T * j.D;
  const float* values = j.present_v + (b * j.KVH + kvh) * j.T * j.D;
  const float* mask = j.mask + (b * j.S + s) * j.T;
  float* out = j.y + (b * j.S + s) * j.H * j.D + h * j.D;
#ifdef MIRRORSD_ATTENTION_AVX2
  if (kHasAvx2 && j.D % 8 == 0) {
    attend_avx2(query, keys, values, mask, j.T, j.D, j.scale, weights.data(), out);
    return;
  }
#endif
  float top = -INFINITY;
  for (int64_t t = 0; t < j.T; ++t) {
    weights[t] = dot(query, keys + t * j.D, j.D) * j.scale + mask[t];
    top = weights[t] > top ? weights[t] : top;
  }
  float total = 0.0f;
  for (int64_t t = 0; t < j.T; ++t) {
    weights[t] = std::exp(weights[t] - top);
    total += weights[t];
  }
  for (int64_t d = 0; d < j.D; ++d) out[d] = 0.0f;
  for (int64_t t = 0; t < j.T; ++t) {
    const float w = weights[t];
    const float* value = values + t * j.D;
    for (int64_t d = 0; d < j.D; ++d) out[d] += w * value[d];
  }
  const float inverse = 1.0f / total;
  for (int64_t d = 0; d < j.D; ++d) out[d] *= inverse;
}

}  // namespace

OrtStatus* Attention::error(OrtErrorCode code, const std::string& what, const std::string& fix) const {
  const std::string text = "mirrorsd.kern GroupedAttention node '" + node_ + "': " + what + ". Fix: " + fix + ".";
  return api_->CreateStatus(code, text.c_str());
}

OrtStatus* Attention::create(const OrtApi* api, const OrtKernelInfo* info, Attention** out) {
  std::unique_ptr<Attention> kernel(new Attention(api, node_name(api, info)));
  int64_t heads = 0, kv_heads = 0;
  float scale = 0.0f;
  OrtStatus* s = api->KernelInfoGetAttribute_int64(info, "num_heads", &heads);
  if (!s) s = api->KernelInfoGetAttribute_int64(info, "kv_num_heads", &kv_heads);
  if (!s) s = api->KernelInfoGetAttribute_float(info, "scale", &scale);
  if (s) {
    api->ReleaseStatus(s);
    return kernel->error(ORT_INVALID_ARGUMENT, "the attributes num_heads, kv_num_heads and scale are required",
                         "rewrite the graph with mirrorsd.devices.kernels.attention_rewrite");
  }
  if (heads < 1 || kv_heads < 1 || heads % kv_heads != 0)
    return kernel->error(ORT_INVALID_ARGUMENT, "num_heads=" + std::to_string(heads) + " is not a multiple of "
                         "kv_num_heads=" + std::to_string(kv_heads), "check the model's head counts");
  kernel->heads_ = heads;
  kernel->kv_heads_ = kv_heads;
  kernel->scale_ = scale;
  *out = kernel.release();
  return nullptr;
}

OrtStatus* Attention::compute(OrtKernelContext* context) const {
  Tensor in[kAttentionInputs];
  for (size_t i = 0; i < kAttentionInputs; ++i) {
    const OrtValue* value = nullptr;
    ATTENTION_RETURN_IF(api_->KernelContext_GetInput(context, i, &value));
    if (!value) return error(ORT_INVALID_ARGUMENT, "input " + std::to_string(i) + " is missing", "give all 8");
    ATTENTION_RETURN_IF(float_tensor(api_, value, in[i]));
  }
  const Tensor& q = in[kQ];
  if (q.dims.size() != 3 || q.dims[2] % heads_ != 0)
    return error(ORT_INVALID_ARGUMENT, "q has shape " + shape_text(q.dims), "feed q as [B, S, num_heads * D]");
  Job j{};
  j.B = q.dims[0];
  j.S = q.dims[1];
  j.H = heads_;
  j.KVH = kv_heads_;
  j.D = q.dims[2] / heads_;
  const Tensor& past = in[kPastK];
  j.P = past.dims.size() == 4 ? past.dims[2] : -1;
  j.T = j.P + j.S;
  j.scale = scale_;
  if (j.D % 2 != 0 || j.D > kMaxHeadDim)
    return error(ORT_NOT_IMPLEMENTED, "head size " + std::to_string(j.D), "use an even head size up to 512");
  const bool shapes_ok = has_dims(in[kK], {j.B, j.S, j.KVH * j.D}) && has_dims(in[kV], {j.B, j.S, j.KVH * j.D}) &&
                         has_dims(in[kCos], {j.B, j.S, j.D}) && has_dims(in[kSin], {j.B, j.S, j.D}) &&
                         has_dims(in[kMask], {j.B, 1, j.S, j.T}) && has_dims(past, {j.B, j.KVH, j.P, j.D}) &&
                         has_dims(in[kPastV], {j.B, j.KVH, j.P, j.D});
  if (j.P < 0 || !shapes_ok)
    return error(ORT_INVALID_ARGUMENT, "inputs of shapes q " + shape_text(q.dims) + ", k " + shape_text(in[kK].dims) +
                 ", v " + shape_text(in[kV].dims) + ", cos " + shape_text(in[kCos].dims) + ", mask " +
                 shape_text(in[kMask].dims) + ", past_k " + shape_text(past.dims) + " do not fit together",
                 "feed the shapes the op's comment lists");
  j.q = q.data;
  j.k = in[kK].data;
  j.v = in[kV].data;
  j.cos = in[kCos].data;
  j.sin = in[kSin].data;
  j.mask = in[kMask].data;
  j.past_k = past.data;
  j.past_v = in[kPastV].data;
  const int64_t y_dims[3] = {j.B, j.S, j.H * j.D};
  const int64_t present_dims[4] = {j.B, j.KVH, j.T, j.D};
  OrtValue* outputs[kAttentionOutputs] = {nullptr, nullptr, nullptr};
  ATTENTION_RETURN_IF(api_->KernelContext_GetOutput(context, 0, y_dims, 3, &outputs[0]));
  ATTENTION_RETURN_IF(api_->KernelContext_GetOutput(context, 1, present_dims, 4, &outputs[1]));
  ATTENTION_RETURN_IF(api_->KernelContext_GetOutput(context, 2, present_dims, 4, &outputs[2]));
  void* data[kAttentionOutputs] = {nullptr, nullptr, nullptr};
  for (size_t i = 0; i < kAttentionOutputs; ++i) ATTENTION_RETURN_IF(api_->GetTensorMutableData(outputs[i], &data[i]));
  j.y = static_cast<float*>(data[0]);
  j.present_k = static_cast<float*>(data[1]);
  j.present_v = static_cast<float*>(data[2]);
  if (j.B == 0 || j.S == 0) {  // nothing new: the presents are the pasts
    for (size_t task = 0; task < static_cast<size_t>(j.B * j.KVH); ++task) append_task(&j, task);
    return nullptr;
  }
  const size_t kv_tasks = static_cast<size_t>(j.B * j.KVH), rows = static_cast<size_t>(j.B * j.H * j.S);
  if (j.B * j.H * j.S * j.T * j.D < kInlineWork) {
    for (size_t task = 0; task < kv_tasks; ++task) append_task(&j, task);
    for (size_t task = 0; task < rows; ++task) row_task(&j, task);
    return nullptr;
  }
  ATTENTION_RETURN_IF(api_->KernelContext_ParallelFor(context, append_task, kv_tasks, 0, &j));
  return api_->KernelContext_ParallelFor(context, row_task, rows, 0, &j);
}

}  // namespace mirrorsd_kern
