// AVX-512 VNNI path (built with -mavx512f -mavx512bw -mavx512vl -mavx512vnni -mfma; called only after cpuid says
// so). A 64-byte vector holds 16 columns x 4 consecutive k; one vpdpbusd per row per 4 k multiplies the unsigned
// weights by the row's 4 signed activations broadcast to every column:
//
//   acc[c] += sum_j w[c][4v+j] * q[4v+j]      (u8 x s8 -> s32, exact; the zero point comes back through corr)
//
// Rows are processed in tiles of up to 8 that share each unpacked weight vector, so B is read once per call for
// M <= 8. A row's float steps are the same instructions in every tile; only the grouping of its exact int32
// additions depends on the tile size (see chains), so its bits do not depend on the tile it sits in.
#include <immintrin.h>

#include <cstring>

#include "qgemm.hpp"

namespace mirrorsd_kern {

namespace {

constexpr int64_t kColumns = 16;  // columns per group
constexpr int kRows = 8;          // rows per tile (8 float accumulators + 8 weight vectors fit in 32 registers)
// Every cache line of the block this many blocks ahead is prefetched (~2.5 KB at 4 bits): with several rows the
// loop body is long, the out-of-order window covers few blocks, and the hardware prefetcher alone left a 5-row
// tile latency-bound, well above the one-row time, when streaming from memory. Into L2 (T1), not L1: an L1 prefetch
// holds one of the core's few L1 miss buffers until the line arrives, which capped the stream; on an Intel Xeon VM
// (Sapphire Rapids class) T1 made a 1536 x 8960 int4 chain 1-6 % faster for one row and 3-9 % for two, and sd on the
// Qwen pair 7-10 % (docs/lab-notes/performance-log.md, "Packed weights in huge pages"). Distances 4-32 were no better.
constexpr int64_t kAhead = 8;

// acc + vpdpbusd(w, the 4 activation bytes at q in every 32-bit lane). With GCC or Clang the bytes are the
// instruction's broadcast memory operand ({1to16}), which GCC 12 does not fold from _mm512_set1_epi32 itself: a
// separate vpbroadcastd per step (40 per block in a tile of 5 rows) and its register cost the compute-bound tiles.
inline __m512i dot4(__m512i acc, __m512i w, const int8_t* q) {
#if defined(__GNUC__)
  typedef int32_t bytes4 __attribute__((may_alias));
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*reinterpret_cast<const bytes4*>(q)));
  return acc;
#else
  int32_t v;
  std::memcpy(&v, q, 4);
  return _mm512_dpbusd_epi32(acc, w, _mm512_set1_epi32(v));
#endif
}

// Weights of one block as 8 vectors, each 16 columns x 4 k (unsigned bytes).
template <int BITS>
inline void load_block(const uint8_t* p, __m512i w[8]) {
  if constexpr (BITS == 4) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int v = 0; v < 4; ++v) {
      const __m512i packed = _mm512_load_si512(p + 64 * v);
      w[v] = _mm512_and_si512(packed, low);
      w[v + 4] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low);
    }
  } else {
    for (int v = 0; v < 8; ++v) w[v] = _mm512_load_si512(p + 64 * v);
  }
}

// Independent integer accumulators per row: a vpdpbusd waits ~5 cycles for the previous one on its accumulator, so
// a tile of few rows splits the 8 steps of a block over several chains (integer sums: the result is the same).
template <int MT>
constexpr int chains() {
  return MT >= 4 ? 1 : (MT >= 2 ? 2 : 4);
}

// y rows [m0, m0 + MT) at columns [n0, n0 + 16) (fewer in the last group) = acc (+ bias).
template <int MT>
inline void store_rows(const __m512 acc[MT], const Shape& s, int64_t m0, int64_t n0, const float* bias, float* y) {
  const int64_t valid = s.N - n0 < kColumns ? s.N - n0 : kColumns;
  const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1u);
  const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + n0) : _mm512_setzero_ps();
  for (int m = 0; m < MT; ++m) {
    const __m512 out = bias ? _mm512_add_ps(acc[m], b) : acc[m];
    _mm512_mask_storeu_ps(y + (m0 + m) * s.N + n0, mask, out);
  }
}

template <int MT, int BITS, bool OFFSETS>
void tile_rows(const Shape& s, const uint8_t* panel, const QuantizedRows& a, int64_t m0, int64_t n0,
               const float* bias, float* y) {
  constexpr int64_t wbytes = kColumns * kBlock * BITS / 8;
  constexpr int64_t stride = wbytes + kColumns * 4 * (OFFSETS ? 2 : 1);  // weights | scales (| offsets)
  constexpr int C = chains<MT>();
  __m512 acc[MT];
  for (int m = 0; m < MT; ++m) acc[m] = _mm512_setzero_ps();
  const uint8_t* p = panel;
  RowCursor r(a, m0, OFFSETS);
  for (int64_t blk = 0; blk < s.kb; ++blk, p += stride, r.next()) {
    for (int64_t line = 0; s.prefetch_for(MT) && line < stride; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(p + kAhead * stride + line), _MM_HINT_T1);
    __m512i w[8];
    load_block<BITS>(p, w);
    __m512i d[MT][C];
    for (int m = 0; m < MT; ++m) {
      d[m][0] = _mm512_set1_epi32(r.corr[m]);  // -zero_point * sum(q): d = sum (w - zp) * q
      for (int c = 1; c < C; ++c) d[m][c] = _mm512_setzero_si512();
    }
    for (int v = 0; v < 8; ++v)  // rows innermost: consecutive vpdpbusd are independent
      for (int m = 0; m < MT; ++m) d[m][v % C] = dot4(d[m][v % C], w[v], r.q + kBlock * m + 4 * v);
    const __m512 wscale = _mm512_load_ps(reinterpret_cast<const float*>(p + wbytes));
    for (int m = 0; m < MT; ++m) {
      for (int c = 1; c < C; ++c) d[m][0] = _mm512_add_epi32(d[m][0], d[m][c]);
      const __m512 ascale = _mm512_set1_ps(r.scale[m]);
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d[m][0]), _mm512_mul_ps(wscale, ascale), acc[m]);
      if constexpr (OFFSETS) {  // step 3's second fma: + float(qsum) * (u * a_scale)
        const __m512 offsets = _mm512_load_ps(reinterpret_cast<const float*>(p + wbytes) + kColumns);
        acc[m] = _mm512_fmadd_ps(_mm512_set1_ps(r.qsum[m]), _mm512_mul_ps(offsets, ascale), acc[m]);
      }
    }
  }
  store_rows<MT>(acc, s, m0, n0, bias, y);
}

// The super-block layout (qgemm.hpp) of a group of 16 columns: a block's scale and offset are rebuilt with the steps
// of superblock_scale, superblock_zero_point and offset(), so every number the tile uses is the one the interleaved
// layout stores.
constexpr int64_t kSuperHead = 2 * kColumns * 4 + 2 * SuperBlocks::kBlocks * kColumns;  // d, dmin, sc, m
constexpr int64_t kSuperWeights = kColumns * kBlock / 2;                                   // one block, 4 bits
constexpr int64_t kSuperStride = kSuperHead + SuperBlocks::kBlocks * kSuperWeights;
constexpr int64_t kSuperAhead = 3072;  // bytes prefetched ahead, about kAhead blocks of the interleaved layout
static_assert(kSuperHead % 64 == 0 && kSuperStride % 64 == 0, "vectors stay 64-byte aligned");

inline __m512 bytes_as_floats(const uint8_t* p) {  // 16 unsigned bytes -> 16 floats (exact)
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(p))));
}

template <int MT>
void superblock_tile(const Shape& s, const uint8_t* panel, const QuantizedRows& a, int64_t m0, int64_t n0,
                     const float* bias, float* y) {
  constexpr int C = chains<MT>();
  constexpr int64_t B = SuperBlocks::kBlocks;
  constexpr int64_t lines = (kSuperStride / B + 63) / 64;  // prefetched per block: a super-block per 8 blocks
  const __m512 center = _mm512_set1_ps(static_cast<float>(s.zero_point()));
  const __m512 zero = _mm512_setzero_ps();
  __m512 acc[MT];
  for (int m = 0; m < MT; ++m) acc[m] = _mm512_setzero_ps();
  const uint8_t* p = panel;
  RowCursor r(a, m0, true);
  for (int64_t t = 0; t < s.kb / B; ++t, p += kSuperStride) {
    const __m512 d = _mm512_load_ps(reinterpret_cast<const float*>(p));
    const __m512 dmin = _mm512_load_ps(reinterpret_cast<const float*>(p) + kColumns);
    for (int64_t j = 0; j < B; ++j) {
      for (int64_t line = 0; s.prefetch_for(MT) && line < lines; ++line)
        _mm_prefetch(reinterpret_cast<const char*>(p + kSuperAhead + (j * lines + line) * 64), _MM_HINT_T1);
      __m512i w[8];
      load_block<4>(p + kSuperHead + j * kSuperWeights, w);
      __m512i dot[MT][C];
      for (int m = 0; m < MT; ++m) {
        dot[m][0] = _mm512_set1_epi32(r.corr[m]);
        for (int c = 1; c < C; ++c) dot[m][c] = _mm512_setzero_si512();
      }
      for (int v = 0; v < 8; ++v)
        for (int m = 0; m < MT; ++m) dot[m][v % C] = dot4(dot[m][v % C], w[v], r.q + kBlock * m + 4 * v);
      // superblock_scale, superblock_zero_point (0 where the scale is 0), then offset(): (center - zp) * scale
      const __m512 wscale = _mm512_mul_ps(bytes_as_floats(p + 2 * kColumns * 4 + j * kColumns), d);
      const __m512 mins = _mm512_mul_ps(bytes_as_floats(p + 2 * kColumns * 4 + (B + j) * kColumns), dmin);
      const __m512 zp = _mm512_maskz_div_ps(_mm512_cmp_ps_mask(wscale, zero, _CMP_NEQ_UQ), mins, wscale);
      const __m512 offsets = _mm512_mul_ps(_mm512_sub_ps(center, zp), wscale);
      for (int m = 0; m < MT; ++m) {
        for (int c = 1; c < C; ++c) dot[m][0] = _mm512_add_epi32(dot[m][0], dot[m][c]);
        const __m512 ascale = _mm512_set1_ps(r.scale[m]);
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[m][0]), _mm512_mul_ps(wscale, ascale), acc[m]);
        acc[m] = _mm512_fmadd_ps(_mm512_set1_ps(r.qsum[m]), _mm512_mul_ps(offsets, ascale), acc[m]);
      }
      r.next();
    }
  }
  store_rows<MT>(acc, s, m0, n0, bias, y);
}

// Step 1 for a whole block of 32, as quantize_block_scalar computes it.
void quantize_block(const float* a, int64_t, int zero_point, int8_t* q, float* scale, int32_t* corr) {
  const __m512 lo = _mm512_loadu_ps(a), hi = _mm512_loadu_ps(a + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
  const __m512 inverse = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
  const __m512i top = _mm512_set1_epi32(127), bottom = _mm512_set1_epi32(-127);
  // cvtps2dq rounds half to even (the default MXCSR mode, which the kernel enforces) and turns NaN into INT_MIN
  const __m512i qlo = _mm512_max_epi32(bottom, _mm512_min_epi32(top, _mm512_cvtps_epi32(_mm512_mul_ps(lo, inverse))));
  const __m512i qhi = _mm512_max_epi32(bottom, _mm512_min_epi32(top, _mm512_cvtps_epi32(_mm512_mul_ps(hi, inverse))));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(qlo));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(qhi));
  *scale = amax / 127.0f;
  *corr = -zero_point * _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
}

struct Traits {
  static constexpr int64_t kWidth = kColumns;
  static constexpr int kMaxTile = kRows;
  static constexpr uint8_t kFlip8 = 0;  // 8-bit weights packed unsigned, as ONNX Runtime stores them
  template <int MT, int BITS, bool OFFSETS>
  static constexpr TileFn tile = tile_rows<MT, BITS, OFFSETS>;
  static constexpr int64_t kSuperStride = ::mirrorsd_kern::kSuperStride;
  template <int MT>
  static constexpr TileFn superblock_tile = ::mirrorsd_kern::superblock_tile<MT>;
};

}  // namespace

const Path& avx512_path() {
  static const Path path = with_superblocks<Traits>(interleaved_path<Traits>("avx512vnni", quantize_block));
  return path;
}

}  // namespace mirrorsd_kern
