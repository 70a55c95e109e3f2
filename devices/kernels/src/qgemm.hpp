// Row-invariant block-quantized GEMM: Y[M, N] = A[M, K] x dequant(B)[K, N] (+ bias), B in 4 or 8 bits per weight,
// one float scale s per block of 32 weights of a column, and either no zero point (symmetric: the center 8 or 128)
// or one float zero point zp per block (w = (c - zp) * s, as ONNX Runtime's MatMulNBits defines it).
//
// Numerics, the same for every instruction-set path (so the paths agree bit for bit, and each row's bits are the
// same whatever M is and however the columns are split across threads):
//   1. each row of A is quantized on its own, per block of 32:  s = max|a| / 127,  q = round_even(a * (127 / max|a|))
//      clamped to [-127, 127] (NaN -> -127), with the scalar steps the same in every path's version;
//   2. per (row, column, block) an exact int32 dot product  d = sum_k (c_k - center) * q_k  (center 8 or 128);
//   3. per (row, column) one float accumulator over the blocks in increasing order:
//          acc = fma(float(d), w_scale * a_scale, acc)      (float(d) is exact: |d| < 2^24)
//      and, with zero points, right after it in the same block:
//          acc = fma(float(qsum), u * a_scale, acc)         qsum = sum_k q_k (exact in float: |qsum| <= 4064),
//      where u = (center - zp) * w_scale is computed once per (column, block) in float32 when B is packed
//      (offset()), so that the two steps add s * a_scale * sum_k (c_k - zp) * q_k up to float rounding;
//   4. y = acc (+ bias).
// Only the column split is parallel (never K), so no step depends on M, on the row tile, or on the thread count.
// A graph without zero points runs the code it ran before (the zero-point steps are a template parameter).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace mirrorsd_kern {

constexpr int64_t kBlock = 32;  // weights per quantization block (the only block size MatMulNBits exports here)

struct Shape {
  int64_t K = 0;   // reduction length (columns of A)
  int64_t N = 0;   // output columns
  int64_t kb = 0;  // blocks per column: ceil(K / 32)
  int bits = 4;    // 4 or 8
  bool offsets = false;  // float zero points given: the packed B holds an offset u per (column, block) (step 3)
  // Tiles of at least this many rows prefetch B ahead of the stream; 0: none (kernel.hpp: prefetch_wanted; no
  // effect on results).
  int prefetch_from = 1;
  bool prefetch_for(int tile_rows) const { return prefetch_from > 0 && tile_rows >= prefetch_from; }
  int zero_point() const { return bits == 4 ? 8 : 128; }  // the center of step 2
  int64_t blob() const { return kBlock * bits / 8; }  // bytes of one block of one column in ONNX Runtime's layout
};

// u of step 3 for a block with scale s and float zero point zp: one float subtraction, one float multiplication.
inline float offset(const Shape& shape, float zero_point, float scale) {
  return (static_cast<float>(shape.zero_point()) - zero_point) * scale;
}

// A's rows quantized per block of 32 (step 1 above); K is padded with zeros to kb * 32. Block-major: a block's rows
// lie side by side, so a tile of rows reads one pointer per block at fixed offsets (row m of a tile at + 32 m).
struct QuantizedRows {
  int64_t rows = 0, kb = 0;
  std::vector<int8_t> q;      // [kb][rows][32]
  std::vector<float> scale;   // [kb][rows]   s of each block
  std::vector<int32_t> corr;  // [kb][rows]   -center * sum of q over the block
  std::vector<float> qsum;    // [kb][rows]   float(sum of q over the block), only for a Shape with offsets
  const int8_t* block_q(int64_t m, int64_t blk) const { return q.data() + (blk * rows + m) * kBlock; }
  float block_scale(int64_t m, int64_t blk) const { return scale[static_cast<size_t>(blk * rows + m)]; }
  int32_t block_corr(int64_t m, int64_t blk) const { return corr[static_cast<size_t>(blk * rows + m)]; }
  float block_qsum(int64_t m, int64_t blk) const { return qsum[static_cast<size_t>(blk * rows + m)]; }
};

// A tile's view of QuantizedRows from its first row on: running pointers advanced one block at a time, so row m of
// the tile is a constant offset (32 m bytes of q, m of the per-block arrays) and a tile's loop carries no per-row
// address arithmetic (a.block_q(m0 + m, blk) and its siblings cost the AVX-512 tiles a multiplication and moves per
// row and block, and with four pointers per row a 5-row tile ran out of general registers).
struct RowCursor {
  const int8_t* q;
  const float* scale;
  const int32_t* corr;
  const float* qsum;  // null without offsets
  int64_t rows;
  RowCursor(const QuantizedRows& a, int64_t m0, bool offsets)
      : q(a.q.data() + m0 * kBlock), scale(a.scale.data() + m0), corr(a.corr.data() + m0),
        qsum(offsets ? a.qsum.data() + m0 : nullptr), rows(a.rows) {}
  void next() {
    q += rows * kBlock;
    scale += rows;
    corr += rows;
    if (qsum) qsum += rows;
  }
};

// One block of one row (step 1): n <= 32 values of a; q gets 32 bytes (zeros past n).
using QuantizeBlock = void (*)(const float* a, int64_t n, int zero_point, int8_t* q, float* scale, int32_t* corr);
void quantize_block_scalar(const float* a, int64_t n, int zero_point, int8_t* q, float* scale, int32_t* corr);

// The scales and zero points of a 4-bit node with offsets, written the way a GGUF Q4_K tensor holds them: per
// column and super-block of 8 blocks (256 weights along K) one float d and one float dmin, per block one small
// integer sc and one m, so that (superblocks.cpp)
//     scale = float(sc) * d,   zero point = float(m) * dmin / scale  (0 where the scale is 0)
// give back the node's float32 scales and zero points bit for bit. A path that packs them this way streams
// 16 + 2 bytes per column and block (plus 8 per super-block) instead of 16 + 8: ~21 % fewer bytes of a carried
// Q4_K node, the same numbers (step 3's u is computed from the same scale and zero point).
struct SuperBlocks {
  static constexpr int64_t kBlocks = 8;  // blocks per super-block
  std::vector<float> d, dmin;            // [N][kb / 8]
  std::vector<uint8_t> sc, m;            // [N][kb]
};
// Fills `out` and returns true when every column's every super-block can be written so (4-bit, offsets, kb a
// multiple of 8); false otherwise (the node keeps the path's usual layout).
bool find_superblocks(const Shape& shape, const float* scales, const float* zero_points, SuperBlocks& out);
// The super-block layout of the SIMD paths, for a group of W columns, one super-block after another:
//   d [W] float | dmin [W] float | sc [8][W] bytes | m [8][W] bytes | 8 blocks of 4-bit weights, each as the
//   interleaved layout below holds a block's weights (16 W bytes)
// 19 W bytes per block plus 8 W per super-block, against 24 W per block in the interleaved layout with offsets.
int64_t superblock_head(int64_t width);    // bytes before the weights
int64_t superblock_stride(int64_t width);  // bytes of one super-block of one group
size_t superblock_layout_bytes(const Shape& shape, int64_t width);
void pack_superblock_layout(const Shape& shape, const uint8_t* b, const SuperBlocks& parts, int64_t width,
                            uint8_t* out);
// The scale and the offset u of block j of a super-block, as a path that unpacks them computes them (the scalar
// form of its vector steps; find_superblocks checks its candidates with these).
inline float superblock_scale(float d, uint8_t sc) { return static_cast<float>(sc) * d; }
inline float superblock_zero_point(float dmin, uint8_t m, float scale) {
  return scale != 0.0f ? static_cast<float>(m) * dmin / scale : 0.0f;
}

// One instruction-set path: its packed layout of B and its GEMM over a range of column groups.
struct Path {
  const char* name;
  int64_t group;  // columns per group (the packed layout's unit of work)
  QuantizeBlock quantize_block;  // for whole blocks (a partial last block goes through quantize_block_scalar)
  // bytes of B packed for this path (B: ONNX Runtime layout [N][kb][blob] uint8; scales and zero_points [N][kb]
  // float, zero_points null when the shape has no offsets)
  size_t (*packed_bytes)(const Shape& shape);
  void (*pack)(const Shape& shape, const uint8_t* b, const float* scales, const float* zero_points, uint8_t* out);
  // Y rows [0, a.rows) for the columns of groups [g0, g1); y is [rows][N], bias is [N] or null.
  void (*gemm)(const Shape& shape, const uint8_t* packed, const QuantizedRows& a, int64_t g0, int64_t g1,
               const float* bias, float* y);
  // Optional (null where the path has none): the super-block layout of a node find_superblocks accepted, its size,
  // packing and GEMM (the same results as pack + gemm on the node's float scales and zero points).
  size_t (*superblock_bytes)(const Shape& shape) = nullptr;
  void (*pack_superblocks)(const Shape& shape, const uint8_t* b, const SuperBlocks& parts, uint8_t* out) = nullptr;
  void (*gemm_superblocks)(const Shape& shape, const uint8_t* packed, const QuantizedRows& a, int64_t g0, int64_t g1,
                           const float* bias, float* y) = nullptr;
};

void quantize_rows(const Path& path, const float* a, int64_t rows, const Shape& shape, QuantizedRows& out);

const Path& scalar_path();
#if defined(__x86_64__) || defined(_M_X64)
const Path& avx2_path();
const Path& avx512_path();
const Path& amx_path();  // the AVX-512 path's layout and numbers, multiplied by AMX tiles
bool amx_ready();        // Linux granted this process the AMX tile state (asked once)
#endif

// Packed layout shared by the SIMD paths, for a group of W columns (W = 16 for AVX-512, 8 for AVX2):
//   groups in order; in a group, blocks in order; a block is  weights | W float scales  (| W float offsets u, for a
//   Shape with offsets).
//   4-bit weights: 4 vectors of 4*W bytes; byte 4c+j of vector v holds column c's weights k = 4v+j (low nibble)
//                  and k = 4(v+4)+j (high nibble), as unsigned 0..15 (zero point 8).
//   8-bit weights: 8 vectors of 4*W bytes; byte 4c+j of vector v holds column c's weight k = 4v+j, unsigned 0..255
//                  XOR'ed with `flip` (0 keeps ONNX Runtime's unsigned byte, 0x80 makes it the signed w - 128).
// Columns past N are padded with zero weights, zero scales and zero offsets.
int64_t interleaved_block_bytes(const Shape& shape, int64_t width);  // one block of one group
size_t interleaved_bytes(const Shape& shape, int64_t width);
void pack_interleaved(const Shape& shape, const uint8_t* b, const float* scales, const float* zero_points,
                      int64_t width, uint8_t flip, uint8_t* out);
// The weights of block blk of group g in that layout (4 or 8 vectors of 4 * width bytes) at w.
void pack_block_weights(const Shape& shape, const uint8_t* b, int64_t g, int64_t blk, int64_t width, uint8_t flip,
                        uint8_t* w);

// A SIMD path over the interleaved layout, from its traits K (in an anonymous namespace of the path's own file, which
// is compiled with its instruction set): K::kWidth columns per group, K::kMaxTile rows per tile at most, K::kFlip8
// (the XOR applied to 8-bit weights when packing), and K::template tile<MT, BITS, OFFSETS>, the TileFn for a tile of
// MT rows (OFFSETS: the Shape has offsets, step 3's second fma).
// Each group's tiles run while its panel is in cache, so B is read from memory once per call.
using TileFn = void (*)(const Shape& s, const uint8_t* panel, const QuantizedRows& a, int64_t first_row,
                        int64_t first_column, const float* bias, float* y);

template <class K, int BITS, bool OFFSETS, int... I>
constexpr std::array<TileFn, sizeof...(I)> tile_table(std::integer_sequence<int, I...>) {
  return {K::template tile<I + 1, BITS, OFFSETS>...};  // entry r - 1 runs a tile of r rows
}

// The tile functions of path K for a shape: [bits][offsets] -> one per row count.
template <class K, int MAX_TILE>
const std::array<TileFn, MAX_TILE>& tiles_for(const Shape& s) {
  static constexpr auto rows = std::make_integer_sequence<int, MAX_TILE>();
  static constexpr std::array<TileFn, MAX_TILE> tables[2][2] = {
      {tile_table<K, 4, false>(rows), tile_table<K, 4, true>(rows)},
      {tile_table<K, 8, false>(rows), tile_table<K, 8, true>(rows)}};
  return tables[s.bits == 8][s.offsets];
}

// Rows [0, a.rows) of the column groups [g0, g1) (width columns each, panel_bytes of packed B each), in the fewest
// tiles that cover the rows, as even as possible (9 rows with tiles of 8 at most: 5 + 4, not 8 + 1).
template <size_t MAX_TILE>
void run_tiles(const std::array<TileFn, MAX_TILE>& tiles, int64_t width, int64_t panel_bytes, const Shape& s,
               const uint8_t* packed, const QuantizedRows& a, int64_t g0, int64_t g1, const float* bias, float* y) {
  const int64_t max_tile = static_cast<int64_t>(MAX_TILE), count = (a.rows + max_tile - 1) / max_tile;
  for (int64_t g = g0; g < g1; ++g)
    for (int64_t t = 0, m0 = 0; t < count; ++t) {
      const int64_t rows = a.rows / count + (t < a.rows % count ? 1 : 0);
      tiles[rows - 1](s, packed + g * panel_bytes, a, m0, g * width, bias, y);
      m0 += rows;
    }
}

template <class K>
void interleaved_gemm(const Shape& s, const uint8_t* packed, const QuantizedRows& a, int64_t g0, int64_t g1,
                      const float* bias, float* y) {
  run_tiles(tiles_for<K, K::kMaxTile>(s), K::kWidth, s.kb * interleaved_block_bytes(s, K::kWidth), s, packed, a, g0,
            g1, bias, y);
}

// The super-block layout's GEMM for a path whose traits K also have K::template superblock_tile<MT> (a TileFn over
// one group's super-blocks) and K::kSuperStride (= superblock_stride(K::kWidth)).
template <class K, int... I>
constexpr std::array<TileFn, sizeof...(I)> superblock_table(std::integer_sequence<int, I...>) {
  return {K::template superblock_tile<I + 1>...};
}

template <class K>
void superblock_gemm(const Shape& s, const uint8_t* packed, const QuantizedRows& a, int64_t g0, int64_t g1,
                     const float* bias, float* y) {
  static constexpr auto tiles = superblock_table<K>(std::make_integer_sequence<int, K::kMaxTile>());
  run_tiles(tiles, K::kWidth, (s.kb / SuperBlocks::kBlocks) * K::kSuperStride, s, packed, a, g0, g1, bias, y);
}

// path with the super-block layout of traits K added (Path's optional members).
template <class K>
Path with_superblocks(Path path) {
  path.superblock_bytes = [](const Shape& s) { return superblock_layout_bytes(s, K::kWidth); };
  path.pack_superblocks = [](const Shape& s, const uint8_t* b, const SuperBlocks& parts, uint8_t* out) {
    pack_superblock_layout(s, b, parts, K::kWidth, out);
  };
  path.gemm_superblocks = superblock_gemm<K>;
  return path;
}

template <class K>
Path interleaved_path(const char* name, QuantizeBlock quantize_block) {
  return Path{name, K::kWidth, quantize_block, [](const Shape& s) { return interleaved_bytes(s, K::kWidth); },
              [](const Shape& s, const uint8_t* b, const float* scales, const float* zero_points, uint8_t* out) {
                pack_interleaved(s, b, scales, zero_points, K::kWidth, s.bits == 8 ? K::kFlip8 : 0, out);
              },
              interleaved_gemm<K>};
}

}  // namespace mirrorsd_kern
