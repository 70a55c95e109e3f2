// AVX2 path (built with -mavx2 -mfma; called only after cpuid says so). A 32-byte vector holds 8 columns x 4
// consecutive k. Without VNNI the u8 x s8 products go through vpmaddubsw (int16 pairs, which saturate) and vpmaddwd:
//   4-bit: unsigned weights 0..15 x activations in [-127, 127]: a pair is at most 2*15*127 = 3810 in magnitude, so
//          the 8 pair-sums of a block (<= 30480) add up in int16 exactly, in any grouping; the zero point comes back
//          through corr.
//   8-bit: signed weights w - 128 in [-128, 127]: vpmaddubsw(|w|, sign(q, w)) multiplies |w| <= 128 by +-q, a pair
//          is at most 2*128*127 = 32512 (exact), widened to int32 at once; no correction is needed.
// Both give the exact integer block dot product, and the float steps are the scalar path's, so this path agrees
// with the others bit for bit.
//
// Cost (an AVX2-only core): with several rows the kernel is bound by the vector pipes, not by memory.
// Per row and block of 8 columns: 8 vpmaddubsw (2 per cycle), 7 vpaddw, vpmaddwd, the corr add, cvt, mul and fma,
// and 10 loads (8 broadcasts of 4 activation bytes, corr, the row's scale; 2 per cycle): the floor is about 7 cycles
// (docs/lab-notes/performance-log.md, the AVX2 multi-row kernel, has what it measured). Rows
// share each weight vector and its unpacking in tiles of up to 6 (5-row windows in one tile), the activations of a
// block lie side by side (one pointer, fixed offsets), and every value is pinned in a register (see pin): left
// alone, the compiler re-associated the int16 sums into trees whose terms spilled to the stack and folded each
// weight load into two instructions, ~12 cycles per row and block.
#include <immintrin.h>

#include <cstring>

#include "qgemm.hpp"

namespace mirrorsd_kern {

namespace {

constexpr int64_t kColumns = 8;  // columns per group
constexpr int kRows = 6;         // rows per tile at most (16 ymm registers: 2 per row + weights and temporaries)
constexpr int64_t kAhead = 16;   // blocks prefetched ahead (~2.5 KB at 4 bits), as in the AVX-512 path

inline __m256i broadcast4(const int8_t* q) {
  int32_t v;
  std::memcpy(&v, q, 4);
  return _mm256_set1_epi32(v);
}

// Keeps v in a register as computed: the compiler neither reloads a vector from memory (it would fold one load into
// several instructions: loads are as scarce as multiplies here) nor reassociates a chain of integer additions into a
// tree whose many live terms spill to the stack. Emits no instruction.
inline void pin(__m256i& v) { asm("" : "+x"(v)); }

// One block for MT rows: the exact sums over the block of (w - zero_point) * q, 8 int32 lanes (columns) per row.
// q points at the block's first row (rows 32 bytes apart). Each weight vector is loaded once and used by every row.
template <int MT, int BITS>
inline void block_dots(const uint8_t* p, const int8_t* q, const int32_t* corr, __m256i d[MT]) {
  const __m256i ones = _mm256_set1_epi16(1);
  if constexpr (BITS == 4) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    __m256i pairs[MT];
    for (int v = 0; v < 4; ++v) {
      __m256i packed = _mm256_load_si256(reinterpret_cast<const __m256i*>(p + 32 * v));
      pin(packed);
      const __m256i lo = _mm256_and_si256(packed, low), hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low);
      for (int m = 0; m < MT; ++m) {
        __m256i t = _mm256_add_epi16(_mm256_maddubs_epi16(lo, broadcast4(q + 32 * m + 4 * v)),
                                     _mm256_maddubs_epi16(hi, broadcast4(q + 32 * m + 4 * (v + 4))));
        pin(t);
        pairs[m] = v == 0 ? t : _mm256_add_epi16(pairs[m], t);
        pin(pairs[m]);
      }
    }
    for (int m = 0; m < MT; ++m) d[m] = _mm256_add_epi32(_mm256_madd_epi16(pairs[m], ones), _mm256_set1_epi32(corr[m]));
  } else {
    for (int m = 0; m < MT; ++m) d[m] = _mm256_setzero_si256();
    for (int v = 0; v < 8; ++v) {
      __m256i w = _mm256_load_si256(reinterpret_cast<const __m256i*>(p + 32 * v));  // signed w - 128
      pin(w);
      const __m256i magnitude = _mm256_abs_epi8(w);
      for (int m = 0; m < MT; ++m) {
        const __m256i signed_q = _mm256_sign_epi8(broadcast4(q + 32 * m + 4 * v), w);
        d[m] = _mm256_add_epi32(d[m], _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, signed_q), ones));
      }
    }
    (void)corr;
  }
}

// y rows [m0, m0 + MT) at columns [n0, n0 + 8) (fewer in the last group) = acc (+ bias).
template <int MT>
inline void store_rows(const __m256 acc[MT], const Shape& s, int64_t m0, int64_t n0, const float* bias, float* y) {
  const int64_t valid = s.N - n0 < kColumns ? s.N - n0 : kColumns;
  for (int m = 0; m < MT; ++m) {
    alignas(32) float out[kColumns];
    _mm256_store_ps(out, acc[m]);
    float* row = y + (m0 + m) * s.N + n0;
    for (int64_t c = 0; c < valid; ++c) row[c] = bias ? out[c] + bias[n0 + c] : out[c];
  }
}

template <int MT, int BITS, bool OFFSETS>
void tile_rows(const Shape& s, const uint8_t* panel, const QuantizedRows& a, int64_t m0, int64_t n0,
               const float* bias, float* y) {
  constexpr int64_t wbytes = kColumns * kBlock * BITS / 8;
  constexpr int64_t stride = wbytes + kColumns * 4 * (OFFSETS ? 2 : 1);  // weights | scales (| offsets)
  __m256 acc[MT];
  for (int m = 0; m < MT; ++m) acc[m] = _mm256_setzero_ps();
  const uint8_t* p = panel;
  RowCursor r(a, m0, OFFSETS);
  for (int64_t blk = 0; blk < s.kb; ++blk, p += stride, r.next()) {
    for (int64_t line = 0; s.prefetch_for(MT) && line < stride; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(p + kAhead * stride + line), _MM_HINT_T0);
    __m256i d[MT];
    block_dots<MT, BITS>(p, r.q, r.corr, d);
    const __m256 wscale = _mm256_load_ps(reinterpret_cast<const float*>(p + wbytes));
    for (int m = 0; m < MT; ++m) {
      const __m256 both = _mm256_mul_ps(wscale, _mm256_set1_ps(r.scale[m]));
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d[m]), both, acc[m]);
      if constexpr (OFFSETS) {  // step 3's second fma: + float(qsum) * (u * a_scale)
        const __m256 offsets = _mm256_load_ps(reinterpret_cast<const float*>(p + wbytes) + kColumns);
        acc[m] = _mm256_fmadd_ps(_mm256_set1_ps(r.qsum[m]), _mm256_mul_ps(offsets, _mm256_set1_ps(r.scale[m])), acc[m]);
      }
    }
  }
  store_rows<MT>(acc, s, m0, n0, bias, y);
}

// The super-block layout (qgemm.hpp) of a group of 8 columns, for nodes whose scales and zero points have Q4_K's
// form: a block's scale and offset are rebuilt with the steps of superblock_scale, superblock_zero_point and
// offset(), so every number the tile uses is the one the interleaved layout stores.
constexpr int64_t kSuperHead = 2 * kColumns * 4 + 2 * SuperBlocks::kBlocks * kColumns;  // d, dmin, sc, m
constexpr int64_t kSuperWeights = kColumns * kBlock / 2;                                   // one block, 4 bits
constexpr int64_t kSuperStride = kSuperHead + SuperBlocks::kBlocks * kSuperWeights;
constexpr int64_t kSuperAhead = kAhead * kSuperStride / SuperBlocks::kBlocks;  // about kAhead blocks
static_assert(kSuperHead % 32 == 0 && kSuperStride % 64 == 0, "vectors stay aligned");

inline __m256 bytes_as_floats(const uint8_t* p) {  // 8 unsigned bytes -> 8 floats (exact)
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

template <int MT>
void superblock_tile(const Shape& s, const uint8_t* panel, const QuantizedRows& a, int64_t m0, int64_t n0,
                     const float* bias, float* y) {
  constexpr int64_t B = SuperBlocks::kBlocks;
  constexpr int64_t lines = (kSuperStride / B + 63) / 64;  // prefetched per block: a super-block per 8 blocks
  const __m256 center = _mm256_set1_ps(static_cast<float>(s.zero_point()));
  const __m256 zero = _mm256_setzero_ps();
  __m256 acc[MT];
  for (int m = 0; m < MT; ++m) acc[m] = _mm256_setzero_ps();
  const uint8_t* p = panel;
  RowCursor r(a, m0, true);
  for (int64_t t = 0; t < s.kb / B; ++t, p += kSuperStride) {
    const __m256 d = _mm256_load_ps(reinterpret_cast<const float*>(p));
    const __m256 dmin = _mm256_load_ps(reinterpret_cast<const float*>(p) + kColumns);
    for (int64_t j = 0; j < B; ++j, r.next()) {
      for (int64_t line = 0; s.prefetch_for(MT) && line < lines; ++line)
        _mm_prefetch(reinterpret_cast<const char*>(p + kSuperAhead + (j * lines + line) * 64), _MM_HINT_T0);
      __m256i dots[MT];
      block_dots<MT, 4>(p + kSuperHead + j * kSuperWeights, r.q, r.corr, dots);
      // superblock_scale, superblock_zero_point (0 where the scale is 0), then offset(): (center - zp) * scale
      const __m256 wscale = _mm256_mul_ps(bytes_as_floats(p + 2 * kColumns * 4 + j * kColumns), d);
      const __m256 mins = _mm256_mul_ps(bytes_as_floats(p + 2 * kColumns * 4 + (B + j) * kColumns), dmin);
      const __m256 zp = _mm256_and_ps(_mm256_div_ps(mins, wscale), _mm256_cmp_ps(wscale, zero, _CMP_NEQ_UQ));
      const __m256 offsets = _mm256_mul_ps(_mm256_sub_ps(center, zp), wscale);
      for (int m = 0; m < MT; ++m) {
        const __m256 both = _mm256_mul_ps(wscale, _mm256_set1_ps(r.scale[m]));
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots[m]), both, acc[m]);
        acc[m] = _mm256_fmadd_ps(_mm256_set1_ps(r.qsum[m]), _mm256_mul_ps(offsets, _mm256_set1_ps(r.scale[m])), acc[m]);
      }
    }
  }
  store_rows<MT>(acc, s, m0, n0, bias, y);
}

// Step 1 for a whole block of 32, as quantize_block_scalar computes it.
void quantize_block(const float* a, int64_t, int zero_point, int8_t* q, float* scale, int32_t* corr) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 v[4], amax8 = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(a + 8 * i);
    amax8 = _mm256_max_ps(amax8, _mm256_andnot_ps(sign, v[i]));
  }
  __m128 amax4 = _mm_max_ps(_mm256_castps256_ps128(amax8), _mm256_extractf128_ps(amax8, 1));
  amax4 = _mm_max_ps(amax4, _mm_movehl_ps(amax4, amax4));
  const float amax = _mm_cvtss_f32(_mm_max_ss(amax4, _mm_shuffle_ps(amax4, amax4, 1)));
  const __m256 inverse = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
  const __m256i top = _mm256_set1_epi32(127), bottom = _mm256_set1_epi32(-127);
  __m256i sum = _mm256_setzero_si256(), r[4];
  for (int i = 0; i < 4; ++i) {  // cvtps2dq: half to even (the enforced MXCSR mode); NaN -> INT_MIN -> -127
    r[i] = _mm256_max_epi32(bottom, _mm256_min_epi32(top, _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inverse))));
    sum = _mm256_add_epi32(sum, r[i]);
  }
  // int32 -> int8 with saturation (values are in range): packs interleave 128-bit lanes, the permute restores order
  const __m256i words = _mm256_packs_epi32(r[0], r[1]), words2 = _mm256_packs_epi32(r[2], r[3]);
  const __m256i bytes8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(words, words2),
                                                     _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), bytes8);
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
  *scale = amax / 127.0f;
  *corr = -zero_point * _mm_cvtsi128_si32(s4);
}

struct Traits {
  static constexpr int64_t kWidth = kColumns;
  static constexpr int kMaxTile = kRows;
  static constexpr uint8_t kFlip8 = 0x80;  // 8-bit weights packed signed w - 128 (see block_dots)
  template <int MT, int BITS, bool OFFSETS>
  static constexpr TileFn tile = tile_rows<MT, BITS, OFFSETS>;
  static constexpr int64_t kSuperStride = ::mirrorsd_kern::kSuperStride;
  template <int MT>
  static constexpr TileFn superblock_tile = ::mirrorsd_kern::superblock_tile<MT>;
};

}  // namespace

const Path& avx2_path() {
  static const Path path = with_superblocks<Traits>(interleaved_path<Traits>("avx2", quantize_block));
  return path;
}

}  // namespace mirrorsd_kern
