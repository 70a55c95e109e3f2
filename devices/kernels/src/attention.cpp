// mirrorsd.kern::GroupedAttention and InPlaceAttention: one decoder layer's attention in one node. GroupedAttention
// replaces the ~30 small nodes an exported graph spends on it (rotary embedding of q and k, the KV-cache
// concatenation, the grouped scores, mask, softmax and weighted sum, the head reshapes), whose per-node cost dominated
// a small draft's forward (devices/kernels/attention_rewrite.py puts it in the draft's graph). InPlaceAttention is
// the same computation on a cache the host keeps: it writes this call's keys and values into the host's buffers
// instead of copying the whole past into new presents every call (devices/kernels/kv_in_place.py puts it in the
// target's graphs; runtime/view_cache.py owns the buffers).
//
//   inputs   q [B, S, H*D]  k, v [B, S, KVH*D]   (projections, bias added, before rotary)
//            cos, sin [B, S, D]                   (the graph's rotary tables: the half-width angles repeated twice)
//            mask [B, 1, S, T]                    additive (0 or a large negative), T = P + S
//     GroupedAttention:  past_k, past_v [B, KVH, P, D]
//     InPlaceAttention:  KVH key views, then KVH value views, each [B, 1, T, D]: slots [0, P) hold the past, and
//                        slots [P, T) receive this call's rows here (ONNX Runtime hands a CPU input's memory to the
//                        kernel as the host fed it; the host keeps the buffer alive for the call)
//   outputs  y [B, S, H*D]   (GroupedAttention also: present_k, present_v [B, KVH, T, D])
//   attributes num_heads (H), kv_num_heads (KVH), scale
//
// Query head h reads KV head h / (H / KVH), as transformers' repeat_kv. Rotary is transformers' rotate_half form:
// x * cos + rotate_half(x) * sin. Each query row is computed alone, in one fixed order, whatever S, T, the rows
// around it or the thread count: a row of a verification window is the bits of the same row decoded alone, which is
// what keeps every decoder equal to one-row decoding (ONNX Runtime's MatMul blocks its reduction by its thread split
// and row count, so a graph's attention products do not have that property).
#include <algorithm>
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
constexpr int64_t kRowsPerTask = 32;      // query rows of one KV head per task (a decoding step's are one task)
constexpr int64_t kRowsPerLongTask = 96;  // ... in a call with at least 4 such tasks per KV head (prompt chunks): each
                                          // task streams its head's keys and values once, so fewer, longer tasks
                                          // read the cache fewer times (which rows share a task never changes a
                                          // row's bits)
constexpr int64_t kSlotBlock = 32;        // slots whose keys (then values) every row of a task reads from L1
constexpr int64_t kPrefetchBlocks = 4;    // how many blocks ahead of the one being read the tiles prefetch, in tasks
                                          // of kRowsPerTask rows at most (see Prefetch; no effect on results)

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
  const float *q, *k, *v, *cos, *sin, *mask, *past_k, *past_v;  // past_k, past_v: null when the cache is in place
  float* y;
  // where batch row b's KV head h keeps its T slots x D: keys[h] + b * kv_stride (the presents, or the host's views)
  std::vector<float*> keys, values;
  int64_t kv_stride;
  int64_t task_rows;   // kRowsPerTask or kRowsPerLongTask
  int64_t row_blocks;  // tasks per (b, KV head): its G * S query rows in blocks of task_rows
};

// Task (b, kvh): the past copied into the present (when there is one), then the new rows (k rotated).
void append_task(void* data, size_t task) {
  const Job& j = *static_cast<const Job*>(data);
  const int64_t b = static_cast<int64_t>(task) / j.KVH, kvh = static_cast<int64_t>(task) % j.KVH;
  const size_t past_floats = static_cast<size_t>(j.P * j.D);
  float* pk = j.keys[kvh] + b * j.kv_stride;
  float* pv = j.values[kvh] + b * j.kv_stride;
  if (past_floats && j.past_k) {
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

// The query rows of one task: rows r of KV head kvh are (g, s) = (r / S, r % S), query head kvh * G + g.
struct Rows {
  int64_t count = 0;
  std::vector<float> queries;  // [count, D], rotated
  std::vector<float> weights;  // scores, then exp(score - max): [T / 32][count][32] on the AVX2 path, [count, T]
                               // on the plain one (the size of whole blocks either way)
  std::vector<float> sums;     // [count, D]: the weighted sums of values
  std::vector<const float*> masks;
  std::vector<float*> outs;
  std::vector<float> tops;     // [count]: each row's largest score
  std::vector<float> totals8;  // [count, 8]: each row's running 8-lane sum of softmax numerators
};

#ifdef MIRRORSD_ATTENTION_AVX2
// The cache lines of the block kPrefetchBlocks ahead, requested a few at a time from the tiles' inner loops. A task
// reads a block's keys (then its values) from memory with its first rows and from L1 with the rest, so the hardware
// prefetcher, which runs only a little ahead of demand loads, idles while the later rows compute: on a 2-core AMD EPYC
// (Zen 3) one KV head of a one-row step at 4096 cached tokens read its cache at ~7.5 GB/s, a plain read of the same
// buffers at ~15. Spread over the block's tiles, the requests keep memory busy during that compute (one-row calls
// 0.79 of the time at 4096 cached slots, the target's one-row step there -8 %: docs/lab-notes/performance-log.md,
// "the cache prefetched in one-row attention"); all of a block's lines requested at its start were no faster (they
// overflow the core's outstanding misses). The long tasks of prompt chunks were no faster with it, and a branch per
// slot cost them 7-12 %: they run the loop without it (attend_rows_avx2<false>).
struct Prefetch {
  const char* next = nullptr;
  int64_t left = 0;      // lines still to request
  int64_t per_step = 0;  // lines per step()

  // The lines of slots [first, first + kSlotBlock) (fewer past `slots`) of `rows` ([slots][dim] floats), in `steps`
  // calls of step(); nothing where the block lies past the end.
  void start(const float* rows, int64_t first, int64_t slots, int64_t dim, int64_t steps) {
    const int64_t count = slots - first < kSlotBlock ? slots - first : kSlotBlock;
    left = count > 0 ? (count * dim * static_cast<int64_t>(sizeof(float)) + 63) / 64 : 0;
    next = left ? reinterpret_cast<const char*>(rows + first * dim) : nullptr;
    per_step = steps > 0 ? (left + steps - 1) / steps : left;
  }
  void step() {
    for (int64_t i = 0; i < per_step && left > 0; ++i, --left, next += 64) _mm_prefetch(next, _MM_HINT_T0);
  }
};

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

// The sums of four 8-lane accumulators, each ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)): one add tree for
// four scores (a, a, a, a gives one score the same bits in every lane).
__attribute__((target("avx2,fma"))) inline __m128 sum4_avx2(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 pairs = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(pairs), _mm256_extractf128_ps(pairs, 1));
}

// ROWS query rows x KEYS (4 or 1) slots of scores: one 8-lane chain per pair over the head size, in the same order
// for every pair, and the same add tree, so a pair's score is the same bits whichever tile computes it; then
// * scale + mask.
template <int ROWS, int KEYS>
__attribute__((target("avx2,fma"))) inline void score_tile(const float* queries, const float* keys, int64_t dim,
                                                           float scale, const float* const* masks, int64_t t,
                                                           float* out, int64_t stride) {
  __m256 acc[ROWS][KEYS];
  for (int r = 0; r < ROWS; ++r) {
    const __m256 q = _mm256_loadu_ps(queries + r * dim);
    for (int c = 0; c < KEYS; ++c) acc[r][c] = _mm256_mul_ps(q, _mm256_loadu_ps(keys + c * dim));
  }
  for (int64_t d = 8; d < dim; d += 8) {
    __m256 key[KEYS];
    for (int c = 0; c < KEYS; ++c) key[c] = _mm256_loadu_ps(keys + c * dim + d);
    for (int r = 0; r < ROWS; ++r) {
      const __m256 q = _mm256_loadu_ps(queries + r * dim + d);
      for (int c = 0; c < KEYS; ++c) acc[r][c] = _mm256_fmadd_ps(q, key[c], acc[r][c]);
    }
  }
  const __m128 scale4 = _mm_set1_ps(scale);
  for (int r = 0; r < ROWS; ++r) {
    if (KEYS == 4) {
      const __m128 sums = sum4_avx2(acc[r][0], acc[r][KEYS > 1], acc[r][KEYS > 2 ? 2 : 0], acc[r][KEYS > 3 ? 3 : 0]);
      _mm_storeu_ps(out + r * stride, _mm_add_ps(_mm_mul_ps(sums, scale4), _mm_loadu_ps(masks[r] + t)));
    } else {
      const __m128 sums = sum4_avx2(acc[r][0], acc[r][0], acc[r][0], acc[r][0]);
      out[r * stride] = _mm_cvtss_f32(sums) * scale + masks[r][t];
    }
  }
}

// Rows [r, r + ROWS) against slots [t0, t1) into their segments of the block's scores (row i at block + i * 32):
// four slots a tile, then one at a time; a step of `ahead` before each four.
template <int ROWS, bool PREFETCH>
__attribute__((target("avx2,fma"))) inline void score_rows(const float* queries, const float* keys, int64_t dim,
                                                           float scale, const float* const* masks, int64_t r,
                                                           int64_t t0, int64_t t1, float* block, Prefetch& ahead) {
  int64_t t = t0;
  for (; t + 4 <= t1; t += 4) {
    if (PREFETCH) ahead.step();
    score_tile<ROWS, 4>(queries + r * dim, keys + t * dim, dim, scale, masks + r, t, block + r * kSlotBlock + t - t0,
                        kSlotBlock);
  }
  for (; t < t1; ++t)
    score_tile<ROWS, 1>(queries + r * dim, keys + t * dim, dim, scale, masks + r, t, block + r * kSlotBlock + t - t0,
                        kSlotBlock);
}

// ROWS rows' sums[.., CHUNKS * 8) += weights[u] * values[u] for u in [0, count) (row r's weights at weights + r *
// kSlotBlock, its sums at sums + r * dim): each lane one chain in slot order, whatever rows share the tile (a row
// alone gets the same bits); the rows share each loaded vector of values. A step of `ahead` per slot.
template <int ROWS, int CHUNKS, bool PREFETCH>
__attribute__((target("avx2,fma"))) inline void accumulate_tile(const float* weights, const float* values,
                                                                int64_t count, int64_t dim, float* sums,
                                                                Prefetch& ahead) {
  __m256 acc[ROWS][CHUNKS];
  for (int r = 0; r < ROWS; ++r)
    for (int c = 0; c < CHUNKS; ++c) acc[r][c] = _mm256_loadu_ps(sums + r * dim + c * 8);
  for (int64_t u = 0; u < count; ++u) {
    if (PREFETCH) ahead.step();
    __m256 w[ROWS];
    for (int r = 0; r < ROWS; ++r) w[r] = _mm256_set1_ps(weights[r * kSlotBlock + u]);
    const float* value = values + u * dim;
    for (int c = 0; c < CHUNKS; ++c) {
      const __m256 v = _mm256_loadu_ps(value + c * 8);
      for (int r = 0; r < ROWS; ++r) acc[r][c] = _mm256_fmadd_ps(w[r], v, acc[r][c]);
    }
  }
  for (int r = 0; r < ROWS; ++r)
    for (int c = 0; c < CHUNKS; ++c) _mm256_storeu_ps(sums + r * dim + c * 8, acc[r][c]);
}

// Rows [r, r + ROWS) of a block's weights against its values, 32 dims a tile, then 8.
template <int ROWS, bool PREFETCH>
__attribute__((target("avx2,fma"))) inline void accumulate_rows(const float* block, const float* values,
                                                                int64_t count, int64_t dim, float* sums,
                                                                Prefetch& ahead) {
  int64_t d = 0;
  for (; d + 32 <= dim; d += 32) accumulate_tile<ROWS, 4, PREFETCH>(block, values + d, count, dim, sums + d, ahead);
  for (; d < dim; d += 8) accumulate_tile<ROWS, 1, PREFETCH>(block, values + d, count, dim, sums + d, ahead);
}

// The largest of top and w[0, count), in registers (a maximum is exact in any order).
__attribute__((target("avx2,fma"))) inline float block_max(const float* w, int64_t count, float top) {
  int64_t u = 0;
  if (count >= 8) {
    __m256 m = _mm256_loadu_ps(w);
    for (u = 8; u + 8 <= count; u += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(w + u));
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    x = _mm_max_ss(x, _mm_movehdup_ps(x));
    const float v = _mm_cvtss_f32(x);
    top = v > top ? v : top;
  }
  for (; u < count; ++u) top = w[u] > top ? w[u] : top;
  return top;
}

// The task's rows against slots [0, T) of one KV head (D a multiple of 8), block by block of kSlotBlock slots: the
// scores of every row (kept block by block, [block][row][kSlotBlock], so a block's are contiguous) and each row's
// maximum; then per block every row's softmax numerators (8 lanes by slot, the lanes past T exact zeros) and their
// running 8-lane sum, then the weighted values three rows a tile. Each row's arithmetic is the same whatever the
// block, the rows beside it, T or the thread: a window's row is the bits of the row alone.
template <bool PREFETCH>
__attribute__((target("avx2,fma"))) void attend_rows_avx2(Rows& rows, const float* keys, const float* values,
                                                          int64_t slots, int64_t dim, float scale) {
  const int64_t n = rows.count, block_floats = n * kSlotBlock;
  const float* queries = rows.queries.data();
  const float* const* masks = rows.masks.data();
  float* weights = rows.weights.data();
  float* tops = rows.tops.data();
  std::fill(tops, tops + n, -INFINITY);
  const int64_t row_tiles = (n + 2) / 3;  // tiles of up to three rows per block
  Prefetch ahead;
  for (int64_t t0 = 0; t0 < slots; t0 += kSlotBlock) {
    const int64_t t1 = t0 + kSlotBlock < slots ? t0 + kSlotBlock : slots;
    float* block = weights + t0 / kSlotBlock * block_floats;
    if (PREFETCH) ahead.start(keys, t0 + kPrefetchBlocks * kSlotBlock, slots, dim, row_tiles * (kSlotBlock / 4));
    int64_t r = 0;
    for (; r + 3 <= n; r += 3) score_rows<3, PREFETCH>(queries, keys, dim, scale, masks, r, t0, t1, block, ahead);
    if (n - r == 2) score_rows<2, PREFETCH>(queries, keys, dim, scale, masks, r, t0, t1, block, ahead);
    if (n - r == 1) score_rows<1, PREFETCH>(queries, keys, dim, scale, masks, r, t0, t1, block, ahead);
    for (r = 0; r < n; ++r) tops[r] = block_max(block + r * kSlotBlock, t1 - t0, tops[r]);
  }
  float* totals8 = rows.totals8.data();
  std::fill(totals8, totals8 + n * 8, 0.0f);
  std::fill(rows.sums.begin(), rows.sums.begin() + n * dim, 0.0f);
  for (int64_t t0 = 0; t0 < slots; t0 += kSlotBlock) {
    const int64_t count = t0 + kSlotBlock < slots ? kSlotBlock : slots - t0, padded = (count + 7) / 8 * 8;
    float* block = weights + t0 / kSlotBlock * block_floats;
    for (int64_t r = 0; r < n; ++r) {
      float* w = block + r * kSlotBlock;
      for (int64_t u = count; u < padded; ++u) w[u] = -INFINITY;
      const __m256 shift = _mm256_set1_ps(tops[r]);
      __m256 total8 = _mm256_loadu_ps(totals8 + r * 8);
      for (int64_t u = 0; u < padded; u += 8) {
        const __m256 e = exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(w + u), shift));
        _mm256_storeu_ps(w + u, e);
        total8 = _mm256_add_ps(total8, e);
      }
      _mm256_storeu_ps(totals8 + r * 8, total8);
    }
    const float* block_values = values + t0 * dim;
    float* sums = rows.sums.data();
    if (PREFETCH)
      ahead.start(values, t0 + kPrefetchBlocks * kSlotBlock, slots, dim, row_tiles * (dim / 32 + dim % 32 / 8) * count);
    int64_t r = 0;
    for (; r + 3 <= n; r += 3)
      accumulate_rows<3, PREFETCH>(block + r * kSlotBlock, block_values, count, dim, sums + r * dim, ahead);
    if (n - r == 2)
      accumulate_rows<2, PREFETCH>(block + r * kSlotBlock, block_values, count, dim, sums + r * dim, ahead);
    if (n - r == 1)
      accumulate_rows<1, PREFETCH>(block + r * kSlotBlock, block_values, count, dim, sums + r * dim, ahead);
  }
  for (int64_t r = 0; r < n; ++r) {
    const __m256 inverse = _mm256_set1_ps(1.0f / sum_avx2(_mm256_loadu_ps(totals8 + r * 8)));
    for (int64_t d = 0; d < dim; d += 8)
      _mm256_storeu_ps(rows.outs[r] + d, _mm256_mul_ps(_mm256_loadu_ps(rows.sums.data() + r * dim + d), inverse));
  }
}

const bool kHasAvx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#endif

// The same in plain C++ (other CPUs, head sizes not a multiple of 8): one row at a time, slots in order.
void attend_rows(Rows& rows, const float* keys, const float* values, int64_t slots, int64_t dim, float scale) {
  for (int64_t r = 0; r < rows.count; ++r) {
    float* weights = rows.weights.data() + r * slots;
    const float* query = rows.queries.data() + r * dim;
    float top = -INFINITY;
    for (int64_t t = 0; t < slots; ++t) {
      weights[t] = dot(query, keys + t * dim, dim) * scale + rows.masks[r][t];
      top = weights[t] > top ? weights[t] : top;
    }
    float total = 0.0f;
    for (int64_t t = 0; t < slots; ++t) {
      weights[t] = std::exp(weights[t] - top);
      total += weights[t];
    }
    float* out = rows.outs[r];
    for (int64_t d = 0; d < dim; ++d) out[d] = 0.0f;
    for (int64_t t = 0; t < slots; ++t) {
      const float w = weights[t];
      const float* value = values + t * dim;
      for (int64_t d = 0; d < dim; ++d) out[d] += w * value[d];
    }
    const float inverse = 1.0f / total;
    for (int64_t d = 0; d < dim; ++d) out[d] *= inverse;
  }
}

// Task (b, kvh, block): up to j.task_rows query rows of one KV head against every slot of that head.
void rows_task(void* data, size_t task) {
  const Job& j = *static_cast<const Job*>(data);
  const int64_t block = static_cast<int64_t>(task) % j.row_blocks;
  const int64_t kvh = static_cast<int64_t>(task) / j.row_blocks % j.KVH;
  const int64_t b = static_cast<int64_t>(task) / (j.row_blocks * j.KVH);
  const int64_t group = j.H / j.KVH, first = block * j.task_rows;
  const int64_t last = first + j.task_rows < group * j.S ? first + j.task_rows : group * j.S;
  thread_local Rows rows;
  rows.count = last - first;
  const size_t n = static_cast<size_t>(rows.count);
  const size_t stride = static_cast<size_t>((j.T + kSlotBlock - 1) / kSlotBlock * kSlotBlock);  // >= T, whole blocks
  rows.queries.resize(n * j.D);
  rows.weights.resize(n * stride);
  rows.sums.resize(n * j.D);
  rows.masks.resize(n);
  rows.outs.resize(n);
  rows.tops.resize(n);
  rows.totals8.resize(n * 8);
  for (int64_t r = first; r < last; ++r) {
    const int64_t g = r / j.S, s = r % j.S, h = kvh * group + g, i = r - first;
    const int64_t angle = (b * j.S + s) * j.D;
    rotate(j.q + (b * j.S + s) * j.H * j.D + h * j.D, j.cos + angle, j.sin + angle, j.D, &rows.queries[i * j.D]);
    rows.masks[i] = j.mask + (b * j.S + s) * j.T;
    rows.outs[i] = j.y + (b * j.S + s) * j.H * j.D + h * j.D;
  }
  const float* keys = j.keys[kvh] + b * j.kv_stride;
  const float* values = j.values[kvh] + b * j.kv_stride;
#ifdef MIRRORSD_ATTENTION_AVX2
  if (kHasAvx2 && j.D % 8 == 0) {
    // decoding steps and windows prefetch; the long tasks of prompt chunks compute long enough per block without
    if (rows.count <= kRowsPerTask) return attend_rows_avx2<true>(rows, keys, values, j.T, j.D, j.scale);
    return attend_rows_avx2<false>(rows, keys, values, j.T, j.D, j.scale);
  }
#endif
  attend_rows(rows, keys, values, j.T, j.D, j.scale);
}

}  // namespace

OrtStatus* Attention::error(OrtErrorCode code, const std::string& what, const std::string& fix) const {
  const std::string text = std::string("mirrorsd.kern ") + (in_place_ ? "InPlaceAttention" : "GroupedAttention") +
                           " node '" + node_ + "': " + what + ". Fix: " + fix + ".";
  return api_->CreateStatus(code, text.c_str());
}

OrtStatus* Attention::create(const OrtApi* api, const OrtKernelInfo* info, bool in_place, Attention** out) {
  std::unique_ptr<Attention> kernel(new Attention(api, node_name(api, info), in_place));
  int64_t heads = 0, kv_heads = 0;
  float scale = 0.0f;
  OrtStatus* s = api->KernelInfoGetAttribute_int64(info, "num_heads", &heads);
  if (!s) s = api->KernelInfoGetAttribute_int64(info, "kv_num_heads", &kv_heads);
  if (!s) s = api->KernelInfoGetAttribute_float(info, "scale", &scale);
  if (s) {
    api->ReleaseStatus(s);
    return kernel->error(ORT_INVALID_ARGUMENT, "the attributes num_heads, kv_num_heads and scale are required",
                         in_place ? "rewrite the graph with mirrorsd.devices.kernels.kv_in_place"
                                  : "rewrite the graph with mirrorsd.devices.kernels.attention_rewrite");
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
  size_t count = 0;
  ATTENTION_RETURN_IF(api_->KernelContext_GetInputCount(context, &count));
  const size_t want = in_place_ ? kPastK + 2 * static_cast<size_t>(kv_heads_) : kAttentionInputs;
  if (count != want)
    return error(ORT_INVALID_ARGUMENT, std::to_string(count) + " inputs", "give " + std::to_string(want) +
                 (in_place_ ? " (q, k, v, cos, sin, mask, then one key view and one value view per KV head)" : ""));
  std::vector<Tensor> in(count);
  for (size_t i = 0; i < count; ++i) {
    const OrtValue* value = nullptr;
    ATTENTION_RETURN_IF(api_->KernelContext_GetInput(context, i, &value));
    if (!value) return error(ORT_INVALID_ARGUMENT, "input " + std::to_string(i) + " is missing", "give all inputs");
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
  const Tensor& past = in[kPastK];  // in place: the first key view, [B, 1, P + S, D]
  j.P = past.dims.size() != 4 ? -1 : in_place_ ? past.dims[2] - j.S : past.dims[2];
  j.T = j.P + j.S;
  j.scale = scale_;
  if (j.D % 2 != 0 || j.D > kMaxHeadDim)
    return error(ORT_NOT_IMPLEMENTED, "head size " + std::to_string(j.D), "use an even head size up to 512");
  bool shapes_ok = has_dims(in[kK], {j.B, j.S, j.KVH * j.D}) && has_dims(in[kV], {j.B, j.S, j.KVH * j.D}) &&
                   has_dims(in[kCos], {j.B, j.S, j.D}) && has_dims(in[kSin], {j.B, j.S, j.D}) &&
                   has_dims(in[kMask], {j.B, 1, j.S, j.T});
  if (in_place_) {
    for (size_t i = kPastK; i < count; ++i) shapes_ok = shapes_ok && has_dims(in[i], {j.B, 1, j.T, j.D});
  } else {
    shapes_ok = shapes_ok && has_dims(past, {j.B, j.KVH, j.P, j.D}) && has_dims(in[kPastV], {j.B, j.KVH, j.P, j.D});
  }
  if (j.P < 0 || !shapes_ok)
    return error(ORT_INVALID_ARGUMENT, "inputs of shapes q " + shape_text(q.dims) + ", k " + shape_text(in[kK].dims) +
                 ", v " + shape_text(in[kV].dims) + ", cos " + shape_text(in[kCos].dims) + ", mask " +
                 shape_text(in[kMask].dims) + (in_place_ ? ", key view 0 " : ", past_k ") + shape_text(past.dims) +
                 " do not fit together",
                 in_place_ ? "feed each view as [B, 1, past + new slots, D] (runtime/view_cache.py)"
                           : "feed the shapes the op's comment lists");
  j.q = q.data;
  j.k = in[kK].data;
  j.v = in[kV].data;
  j.cos = in[kCos].data;
  j.sin = in[kSin].data;
  j.mask = in[kMask].data;
  const int64_t y_dims[3] = {j.B, j.S, j.H * j.D};
  OrtValue* y = nullptr;
  ATTENTION_RETURN_IF(api_->KernelContext_GetOutput(context, 0, y_dims, 3, &y));
  void* y_data = nullptr;
  ATTENTION_RETURN_IF(api_->GetTensorMutableData(y, &y_data));
  j.y = static_cast<float*>(y_data);
  if (in_place_) {  // the host's buffers: the past is there already, the new slots are written into them
    for (int64_t h = 0; h < j.KVH; ++h) {
      j.keys.push_back(in[kPastK + h].data);
      j.values.push_back(in[kPastK + j.KVH + h].data);
    }
    j.kv_stride = j.T * j.D;
  } else {
    j.past_k = past.data;
    j.past_v = in[kPastV].data;
    const int64_t present_dims[4] = {j.B, j.KVH, j.T, j.D};
    float* presents[2] = {nullptr, nullptr};
    for (size_t i = 0; i < 2; ++i) {
      OrtValue* output = nullptr;
      void* data = nullptr;
      ATTENTION_RETURN_IF(api_->KernelContext_GetOutput(context, i + 1, present_dims, 4, &output));
      ATTENTION_RETURN_IF(api_->GetTensorMutableData(output, &data));
      presents[i] = static_cast<float*>(data);
    }
    for (int64_t h = 0; h < j.KVH; ++h) {
      j.keys.push_back(presents[0] + h * j.T * j.D);
      j.values.push_back(presents[1] + h * j.T * j.D);
    }
    j.kv_stride = j.KVH * j.T * j.D;
  }
  const size_t kv_tasks = static_cast<size_t>(j.B * j.KVH);
  if (j.B == 0 || j.S == 0) {  // nothing new: the presents are the pasts
    for (size_t task = 0; task < kv_tasks; ++task) append_task(&j, task);
    return nullptr;
  }
  const int64_t head_rows = j.H / j.KVH * j.S;
  j.task_rows = head_rows >= 4 * kRowsPerLongTask ? kRowsPerLongTask : kRowsPerTask;
  j.row_blocks = (head_rows + j.task_rows - 1) / j.task_rows;
  const size_t row_tasks = static_cast<size_t>(j.B * j.KVH * j.row_blocks);
  if (j.B * j.H * j.S * j.T * j.D < kInlineWork) {
    for (size_t task = 0; task < kv_tasks; ++task) append_task(&j, task);
    for (size_t task = 0; task < row_tasks; ++task) rows_task(&j, task);
    return nullptr;
  }
  ATTENTION_RETURN_IF(api_->KernelContext_ParallelFor(context, append_task, kv_tasks, 0, &j));
  return api_->KernelContext_ParallelFor(context, rows_task, row_tasks, 0, &j);
}

}  // namespace mirrorsd_kern
