// Finding a node's Q4_K super-blocks in its float scales and zero points (qgemm.hpp: SuperBlocks).
//
// A carried Q4_K tensor (export/gguf_blocks.py) has, per column and block j of a super-block, scale s_j = d * sc_j
// and zero point zp_j = (dmin * m_j) / s_j, with d, dmin fp16 and sc_j, m_j 6-bit integers; GGUF's quantizer gives
// the largest sc_j and m_j of a super-block the value 63. So d is s_max / q for a small integer q (63 first), and
// dmin is within a few float32 steps of max(zp_j * s_j) / q. Every candidate is checked with the very float steps a
// path computes (superblock_scale, superblock_zero_point) and kept only when it gives back every s_j and zp_j bit
// for bit; a node with any super-block that has no such form keeps the usual layout. Scalar code, run once per node
// when its weights are packed; the super-block layout's packing is here too (the SIMD paths share it).
#include <cmath>
#include <cstring>

#include "qgemm.hpp"

namespace mirrorsd_kern {

namespace {

constexpr int kLargestInteger = 63;  // sc_j and m_j are 6-bit in Q4_K
constexpr int kNeighbours = 3;      // float32 steps tried on each side of an estimated dmin

bool same_bits(float a, float b) { return std::memcmp(&a, &b, sizeof(float)) == 0; }

// Integers n_j = round(target_j / unit) in [0, 255] for which check(j, n_j) holds for every j.
template <class Check>
bool integers_for(const float* target, int64_t count, float unit, uint8_t* out, Check check) {
  for (int64_t j = 0; j < count; ++j) {
    const float n = unit != 0.0f ? std::nearbyint(target[j] / unit) : 0.0f;
    if (!(n >= 0.0f && n <= 255.0f)) return false;
    out[j] = static_cast<uint8_t>(n);
    if (!check(j, out[j])) return false;
  }
  return true;
}

// d and sc_j with superblock_scale(d, sc_j) == s_j for the super-block's scales s[0..count).
bool find_scales(const float* s, int64_t count, float& d, uint8_t* sc) {
  float largest = 0.0f;
  for (int64_t j = 0; j < count; ++j) {
    if (!(s[j] >= 0.0f) || !std::isfinite(s[j])) return false;
    largest = s[j] > largest ? s[j] : largest;
  }
  const auto fits = [&](float unit) {
    return integers_for(s, count, unit, sc,
                        [&](int64_t j, uint8_t n) { return same_bits(superblock_scale(unit, n), s[j]); });
  };
  if (largest == 0.0f) return d = 0.0f, fits(0.0f);
  for (int q = kLargestInteger; q >= 1; --q) {
    d = largest / static_cast<float>(q);
    if (fits(d)) return true;
  }
  return false;
}

// dmin and m_j with superblock_zero_point(dmin, m_j, s_j) == zp_j.
bool find_zero_points(const float* s, const float* zp, int64_t count, float& dmin, uint8_t* m) {
  float mins[SuperBlocks::kBlocks];  // dmin * m_j, up to the rounding of zp_j
  float largest = 0.0f;
  for (int64_t j = 0; j < count; ++j) {
    if (!std::isfinite(zp[j])) return false;
    mins[j] = static_cast<float>(static_cast<double>(zp[j]) * static_cast<double>(s[j]));
    if (mins[j] < 0.0f) return false;
    largest = mins[j] > largest ? mins[j] : largest;
  }
  const auto fits = [&](float unit) {
    return integers_for(mins, count, unit, m, [&](int64_t j, uint8_t n) {
      return same_bits(superblock_zero_point(unit, n, s[j]), zp[j]);
    });
  };
  if (largest == 0.0f) return dmin = 0.0f, fits(0.0f);
  for (int q = kLargestInteger; q >= 1; --q) {
    const float estimate = largest / static_cast<float>(q);
    float below = estimate, above = estimate;
    if (fits(estimate)) return dmin = estimate, true;
    for (int step = 0; step < kNeighbours; ++step) {
      below = std::nextafter(below, 0.0f);
      above = std::nextafter(above, INFINITY);
      if (fits(below)) return dmin = below, true;
      if (fits(above)) return dmin = above, true;
    }
  }
  return false;
}

}  // namespace

bool find_superblocks(const Shape& shape, const float* scales, const float* zero_points, SuperBlocks& out) {
  constexpr int64_t B = SuperBlocks::kBlocks;
  if (shape.bits != 4 || !shape.offsets || !zero_points || shape.kb % B != 0) return false;
  const int64_t supers = shape.kb / B;
  out.d.assign(static_cast<size_t>(shape.N * supers), 0.0f);
  out.dmin.assign(out.d.size(), 0.0f);
  out.sc.assign(static_cast<size_t>(shape.N * shape.kb), 0);
  out.m.assign(out.sc.size(), 0);
  for (int64_t n = 0; n < shape.N; ++n)
    for (int64_t t = 0; t < supers; ++t) {
      const int64_t first = n * shape.kb + t * B, at = n * supers + t;
      if (!find_scales(scales + first, B, out.d[at], out.sc.data() + first)) return false;
      if (!find_zero_points(scales + first, zero_points + first, B, out.dmin[at], out.m.data() + first)) return false;
    }
  return true;
}

int64_t superblock_head(int64_t width) { return 2 * width * 4 + 2 * SuperBlocks::kBlocks * width; }

int64_t superblock_stride(int64_t width) {
  return superblock_head(width) + SuperBlocks::kBlocks * width * kBlock / 2;
}

size_t superblock_layout_bytes(const Shape& shape, int64_t width) {
  const int64_t groups = (shape.N + width - 1) / width;
  return static_cast<size_t>(groups * (shape.kb / SuperBlocks::kBlocks) * superblock_stride(width));
}

void pack_superblock_layout(const Shape& s, const uint8_t* b, const SuperBlocks& parts, int64_t width,
                            uint8_t* out) {
  constexpr int64_t B = SuperBlocks::kBlocks;
  const int64_t weights = width * kBlock / 2;  // one block's codes, as the interleaved layout packs them
  const int64_t groups = (s.N + width - 1) / width, supers = s.kb / B;
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t t = 0; t < supers; ++t) {
      uint8_t* o = out + (g * supers + t) * superblock_stride(width);
      float* d = reinterpret_cast<float*>(o);
      float* dmin = d + width;
      uint8_t* sc = o + 2 * width * 4;
      uint8_t* m = sc + B * width;
      for (int64_t c = 0; c < width; ++c) {
        const int64_t n = g * width + c;
        const bool real = n < s.N;  // padding columns: scale 0 and offset 0, as the interleaved layout pads them
        d[c] = real ? parts.d[static_cast<size_t>(n * supers + t)] : 0.0f;
        dmin[c] = real ? parts.dmin[static_cast<size_t>(n * supers + t)] : 0.0f;
        for (int64_t j = 0; j < B; ++j) {
          sc[j * width + c] = real ? parts.sc[static_cast<size_t>(n * s.kb + t * B + j)] : 0;
          m[j * width + c] = real ? parts.m[static_cast<size_t>(n * s.kb + t * B + j)] : 0;
        }
      }
      for (int64_t j = 0; j < B; ++j)
        pack_block_weights(s, b, g, t * B + j, width, 0, o + superblock_head(width) + j * weights);
    }
}

}  // namespace mirrorsd_kern
