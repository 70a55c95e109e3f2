// AMX path (built with the AVX-512 flags plus -mamx-tile -mamx-int8; called only after cpuid says so and Linux has
// granted the process the tile data state, see amx_ready). It reads the AVX-512 path's packed layout (16 columns per
// group) and computes the same numbers:
//
//   one tdpbsud per block of 32 k and tile of up to 16 rows:  C[m][c] = sum_k q[m][k] * w[c][k]
//       A = the rows' activations of the block (s8, rows 32 bytes apart: QuantizedRows' block-major layout, loaded
//           as it lies), B = the block's weights as 8 rows of 16 columns x 4 k (u8: the AVX-512 path's 8 unpacked
//           vectors, stored once to a small buffer for 4-bit weights; 8-bit weights are loaded where they lie);
//   then per row the AVX-512 path's float steps: d = C + corr (exact), acc = fma(float(d), w_scale * a_scale, acc)
//   (and, with zero points, acc = fma(float(qsum), u * a_scale, acc)).
//
// The integer sums are exact whatever the order the tile unit adds them in, and the float steps are the same
// instructions in the same block order, so every row agrees bit for bit with the other paths, whatever M. The weights
// of a group are read once for all the rows of a call (M <= 16), and the multiplies cost one tile operation per block
// instead of 8 vpdpbusd per row. Calls of up to 8 rows (decode steps, verification windows) run the AVX-512 path's
// tiles, which are faster there; every tile function gives the same bits, so a row's result never depends on which
// one ran it.
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "qgemm.hpp"

#ifdef __linux__
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace mirrorsd_kern {

namespace {

constexpr int64_t kColumns = 16;  // columns per group: the AVX-512 path's layout
constexpr int kRows = 16;         // rows per tile at most (the tile unit's limit)
constexpr int64_t kAhead = 8;     // blocks prefetched ahead, as in the AVX-512 path
constexpr int kUnroll = 2;        // blocks whose tile products are in flight together
// Fewer rows than this run the AVX-512 path's tiles (same layout, same bits): per block, the tile round trip (the
// unpacked weights stored and loaded as a tile, the products stored and reloaded) costs more than 8 vpdpbusd per row
// for up to 8 rows, as measured on a Sapphire Rapids class Xeon.
constexpr int64_t kTileFromRows = 9;

// Tiles: C of block u is tile u, A of block u is tile 2 + u, B of block u is tile 4 + u.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

void load_config(int m) {
  TileConfig config;
  for (int u = 0; u < kUnroll; ++u) {
    config.rows[u] = static_cast<uint8_t>(m);  // C: m rows x 16 int32
    config.colsb[u] = 64;
    config.rows[2 + u] = static_cast<uint8_t>(m);  // A: m rows x 32 s8
    config.colsb[2 + u] = 32;
    config.rows[4 + u] = 8;  // B: 8 rows (k / 4) x 16 columns x 4 k
    config.colsb[4 + u] = 64;
  }
  _tile_loadconfig(&config);
}

template <int BITS>
inline const uint8_t* block_weights(const uint8_t* p, uint8_t* buffer) {
  if constexpr (BITS == 8) {
    (void)buffer;
    return p;  // already 8 rows of 64 unsigned bytes
  } else {
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int v = 0; v < 4; ++v) {
      const __m512i packed = _mm512_load_si512(p + 64 * v);
      _mm512_store_si512(buffer + 64 * v, _mm512_and_si512(packed, low));
      _mm512_store_si512(buffer + 64 * (v + 4), _mm512_and_si512(_mm512_srli_epi16(packed, 4), low));
    }
    return buffer;
  }
}

// Block blk's products for rows [m0, m0 + MT) of one group, into C tile 0 or 1 (GCC's tile intrinsics take the
// tile numbers as literal text, so each has its own line).
template <int BITS>
inline void block_product_0(const uint8_t* p, const QuantizedRows& a, int64_t m0, int64_t blk, uint8_t* buffer) {
  _tile_zero(0);
  _tile_loadd(2, a.block_q(m0, blk), kBlock);
  _tile_loadd(4, block_weights<BITS>(p, buffer), 64);
  _tile_dpbsud(0, 2, 4);
}

template <int BITS>
inline void block_product_1(const uint8_t* p, const QuantizedRows& a, int64_t m0, int64_t blk, uint8_t* buffer) {
  _tile_zero(1);
  _tile_loadd(3, a.block_q(m0, blk), kBlock);
  _tile_loadd(5, block_weights<BITS>(p, buffer), 64);
  _tile_dpbsud(1, 3, 5);
}

// wscale_at: the block's 16 scales, followed by its 16 offsets when OFFSETS.
template <int MT, bool OFFSETS>
inline void accumulate(const int32_t* c, const float* wscale_at, const QuantizedRows& a, int64_t m0, int64_t blk,
                       __m512 acc[MT]) {
  const __m512 wscale = _mm512_load_ps(wscale_at);
  for (int m = 0; m < MT; ++m) {
    const __m512i d = _mm512_add_epi32(_mm512_load_si512(c + 16 * m), _mm512_set1_epi32(a.block_corr(m0 + m, blk)));
    const __m512 ascale = _mm512_set1_ps(a.block_scale(m0 + m, blk));
    acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(wscale, ascale), acc[m]);
    if constexpr (OFFSETS) {  // step 3's second fma, as in the AVX-512 path
      const __m512 offsets = _mm512_load_ps(wscale_at + kColumns);
      acc[m] = _mm512_fmadd_ps(_mm512_set1_ps(a.block_qsum(m0 + m, blk)), _mm512_mul_ps(offsets, ascale), acc[m]);
    }
  }
}

template <int MT, int BITS, bool OFFSETS>
void tile_rows(const Shape& s, const uint8_t* panel, const QuantizedRows& a, int64_t m0, int64_t n0,
               const float* bias, float* y) {
  constexpr int64_t wbytes = kColumns * kBlock * BITS / 8;
  constexpr int64_t stride = wbytes + kColumns * 4 * (OFFSETS ? 2 : 1);  // weights | scales (| offsets)
  alignas(64) uint8_t buffer[kUnroll][512];
  alignas(64) int32_t c[kUnroll][16 * MT];
  __m512 acc[MT];
  for (int m = 0; m < MT; ++m) acc[m] = _mm512_setzero_ps();
  const uint8_t* p = panel;
  int64_t blk = 0;
  for (; blk + 2 <= s.kb; blk += 2, p += 2 * stride) {
    for (int64_t line = 0; s.prefetch_for(MT) && line < 2 * stride; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(p + kAhead * stride + line), _MM_HINT_T0);
    block_product_0<BITS>(p, a, m0, blk, buffer[0]);
    block_product_1<BITS>(p + stride, a, m0, blk + 1, buffer[1]);
    _tile_stored(0, c[0], 64);
    _tile_stored(1, c[1], 64);
    accumulate<MT, OFFSETS>(c[0], reinterpret_cast<const float*>(p + wbytes), a, m0, blk, acc);  // block order kept
    accumulate<MT, OFFSETS>(c[1], reinterpret_cast<const float*>(p + stride + wbytes), a, m0, blk + 1, acc);
  }
  if (blk < s.kb) {
    block_product_0<BITS>(p, a, m0, blk, buffer[0]);
    _tile_stored(0, c[0], 64);
    accumulate<MT, OFFSETS>(c[0], reinterpret_cast<const float*>(p + wbytes), a, m0, blk, acc);
  }
  const int64_t valid = s.N - n0 < kColumns ? s.N - n0 : kColumns;
  const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1u);
  const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + n0) : _mm512_setzero_ps();
  for (int m = 0; m < MT; ++m) {
    const __m512 out = bias ? _mm512_add_ps(acc[m], b) : acc[m];
    _mm512_mask_storeu_ps(y + (m0 + m) * s.N + n0, mask, out);
  }
}

struct Traits {
  static constexpr int64_t kWidth = kColumns;
  static constexpr int kMaxTile = kRows;
  static constexpr uint8_t kFlip8 = 0;  // 8-bit weights unsigned, as the AVX-512 path packs them
  template <int MT, int BITS, bool OFFSETS>
  static constexpr TileFn tile = tile_rows<MT, BITS, OFFSETS>;
};

// interleaved_gemm's loop, with the tile configuration loaded once per tile height and released at the end (the
// tile state is per thread; a task may run on any of ONNX Runtime's threads).
void amx_gemm(const Shape& s, const uint8_t* packed, const QuantizedRows& a, int64_t g0, int64_t g1,
              const float* bias, float* y) {
  if (a.rows < kTileFromRows) return avx512_path().gemm(s, packed, a, g0, g1, bias, y);  // the same bits, sooner
  const auto& tiles = tiles_for<Traits, kRows>(s);
  const int64_t panel_bytes = s.kb * interleaved_block_bytes(s, kColumns);
  const int64_t count = (a.rows + kRows - 1) / kRows;
  int64_t loaded = 0;
  for (int64_t g = g0; g < g1; ++g)
    for (int64_t t = 0, m0 = 0; t < count; ++t) {
      const int64_t rows = a.rows / count + (t < a.rows % count ? 1 : 0);
      if (rows != loaded) load_config(static_cast<int>(loaded = rows));
      tiles[rows - 1](s, packed + g * panel_bytes, a, m0, g * kColumns, bias, y);
      m0 += rows;
    }
  _tile_release();
}

}  // namespace

bool amx_ready() {
#ifdef __linux__
  // The kernel hands out the tile data state (8 KiB per thread's saved context) only on request, per process.
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  static const bool granted = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  return granted;
#else
  return false;
#endif
}

const Path& amx_path() {
  static const Path path{"amx", kColumns, avx512_path().quantize_block,
                         [](const Shape& sh) { return interleaved_bytes(sh, kColumns); },
                         [](const Shape& sh, const uint8_t* b, const float* scales, const float* zero_points,
                            uint8_t* out) { pack_interleaved(sh, b, scales, zero_points, kColumns, 0, out); },
                         amx_gemm};
  return path;
}

}  // namespace mirrorsd_kern
