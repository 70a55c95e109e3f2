// The parts every path shares: activation quantization, the interleaved packing, and the scalar reference path
// (which reads ONNX Runtime's own layout of B). Built without any -m flag, so it runs on any x86-64 (or other) CPU.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "qgemm.hpp"

namespace mirrorsd_kern {

// q = round_even(a * 127 / max|a|), s = max|a| / 127. The SIMD versions compute the same operations: max is exact,
// one float division, one float multiplication per value, rounding half to even, the same clamping.
void quantize_block_scalar(const float* a, int64_t n, int zero_point, int8_t* q, float* scale, int32_t* corr) {
  float amax = 0.0f;
  for (int64_t k = 0; k < n; ++k) amax = std::max(amax, std::fabs(a[k]));
  const float inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
  int32_t sum = 0;
  for (int64_t k = 0; k < kBlock; ++k) {
    // nearbyint rounds half to even in the default rounding mode; min/max also map NaN to -127 without UB
    const float r = k < n ? std::nearbyint(a[k] * inverse) : 0.0f;
    const int v = static_cast<int>(std::min(127.0f, std::max(-127.0f, r)));
    q[k] = static_cast<int8_t>(v);
    sum += v;
  }
  *scale = amax / 127.0f;
  *corr = -zero_point * sum;
}

void quantize_rows(const Path& path, const float* a, int64_t rows, const Shape& shape, QuantizedRows& out) {
  out.rows = rows;
  out.kb = shape.kb;
  out.q.resize(static_cast<size_t>(rows * shape.kb * kBlock));
  out.scale.resize(static_cast<size_t>(rows * shape.kb));
  out.corr.resize(static_cast<size_t>(rows * shape.kb));
  out.qsum.resize(shape.offsets ? static_cast<size_t>(rows * shape.kb) : 0);
  for (int64_t m = 0; m < rows; ++m) {
    const float* row = a + m * shape.K;
    for (int64_t b = 0; b < shape.kb; ++b) {
      const int64_t n = std::min(kBlock, shape.K - b * kBlock), at = b * rows + m;
      (n == kBlock ? path.quantize_block : quantize_block_scalar)(row + b * kBlock, n, shape.zero_point(),
                                                                  out.q.data() + at * kBlock, out.scale.data() + at,
                                                                  out.corr.data() + at);
      if (shape.offsets) out.qsum[static_cast<size_t>(at)] = static_cast<float>(-out.corr[at] / shape.zero_point());
    }
  }
}

int64_t interleaved_block_bytes(const Shape& shape, int64_t width) {
  return width * kBlock * shape.bits / 8 + width * 4 * (shape.offsets ? 2 : 1);  // weights, scales (, offsets)
}

size_t interleaved_bytes(const Shape& shape, int64_t width) {
  const int64_t groups = (shape.N + width - 1) / width;
  return static_cast<size_t>(groups * shape.kb * interleaved_block_bytes(shape, width));
}

namespace {

// Weight k (0..31) of block b of column n, unsigned (0..15 or 0..255), from ONNX Runtime's layout.
inline unsigned weight(const Shape& s, const uint8_t* b, int64_t n, int64_t blk, int64_t k) {
  const uint8_t* blob = b + (n * s.kb + blk) * s.blob();
  if (s.bits == 8) return blob[k];
  return (k & 1) ? (blob[k / 2] >> 4) : (blob[k / 2] & 0x0F);
}

}  // namespace

void pack_block_weights(const Shape& s, const uint8_t* b, int64_t g, int64_t blk, int64_t width, uint8_t flip,
                        uint8_t* w) {
  for (int64_t c = 0; c < width; ++c) {
    const int64_t n = g * width + c;
    const bool real = n < s.N;
    for (int64_t v = 0; v < (s.bits == 4 ? 4 : 8); ++v) {
      for (int64_t j = 0; j < 4; ++j) {
        uint8_t* dst = w + v * 4 * width + 4 * c + j;
        if (s.bits == 4) {
          const unsigned lo = real ? weight(s, b, n, blk, 4 * v + j) : 8;
          const unsigned hi = real ? weight(s, b, n, blk, 4 * (v + 4) + j) : 8;
          *dst = static_cast<uint8_t>(lo | (hi << 4));
        } else {
          *dst = static_cast<uint8_t>((real ? weight(s, b, n, blk, 4 * v + j) : 128) ^ flip);
        }
      }
    }
  }
}

void pack_interleaved(const Shape& s, const uint8_t* b, const float* scales, const float* zero_points,
                      int64_t width, uint8_t flip, uint8_t* out) {
  const int64_t groups = (s.N + width - 1) / width;
  const int64_t wbytes = width * kBlock * s.bits / 8;
  for (int64_t g = 0; g < groups; ++g) {
    for (int64_t blk = 0; blk < s.kb; ++blk) {
      float* sc = reinterpret_cast<float*>(out + wbytes);
      float* offsets = sc + width;  // only for a shape with offsets
      pack_block_weights(s, b, g, blk, width, flip, out);
      out += interleaved_block_bytes(s, width);
      for (int64_t c = 0; c < width; ++c) {
        const int64_t n = g * width + c;
        const bool real = n < s.N;
        sc[c] = real ? scales[n * s.kb + blk] : 0.0f;
        if (s.offsets) offsets[c] = real ? offset(s, zero_points[n * s.kb + blk], sc[c]) : 0.0f;
      }
    }
  }
}

namespace {

// Scalar reference: B kept in ONNX Runtime's layout (a plain copy), weights | scales [N][kb] (| offsets [N][kb]).
size_t scalar_bytes(const Shape& s) { return static_cast<size_t>(s.N * s.kb * (s.blob() + (s.offsets ? 8 : 4))); }

void scalar_pack(const Shape& s, const uint8_t* b, const float* scales, const float* zero_points, uint8_t* out) {
  std::memcpy(out, b, static_cast<size_t>(s.N * s.kb * s.blob()));
  std::memcpy(out + s.N * s.kb * s.blob(), scales, static_cast<size_t>(s.N * s.kb * 4));
  float* offsets = reinterpret_cast<float*>(out + s.N * s.kb * (s.blob() + 4));
  if (s.offsets)
    for (int64_t i = 0; i < s.N * s.kb; ++i) offsets[i] = offset(s, zero_points[i], scales[i]);
}

void scalar_gemm(const Shape& s, const uint8_t* packed, const QuantizedRows& a, int64_t g0, int64_t g1,
                 const float* bias, float* y) {
  const float* scales = reinterpret_cast<const float*>(packed + s.N * s.kb * s.blob());
  const float* offsets = scales + s.N * s.kb;  // only for a shape with offsets
  for (int64_t m = 0; m < a.rows; ++m) {
    for (int64_t n = g0; n < g1; ++n) {
      float acc = 0.0f;
      for (int64_t blk = 0; blk < s.kb; ++blk) {
        const int8_t* q = a.block_q(m, blk);
        int32_t d = a.block_corr(m, blk);  // -zero_point * sum(q): with it, d = sum (w - zero_point) * q
        for (int64_t k = 0; k < kBlock; ++k) d += static_cast<int32_t>(weight(s, packed, n, blk, k)) * q[k];
        const float both = scales[n * s.kb + blk] * a.block_scale(m, blk);
        acc = std::fma(static_cast<float>(d), both, acc);
        if (s.offsets) acc = std::fma(a.block_qsum(m, blk), offsets[n * s.kb + blk] * a.block_scale(m, blk), acc);
      }
      y[m * s.N + n] = bias ? acc + bias[n] : acc;
    }
  }
}

}  // namespace

const Path& scalar_path() {
  static const Path path{"scalar", 1, quantize_block_scalar, scalar_bytes, scalar_pack, scalar_gemm};
  return path;
}

}  // namespace mirrorsd_kern
