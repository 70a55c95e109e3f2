// How much a one-row Q4_K GEMV gains from integer sums across a super-block (lab prototype, not the kernel).
//
//   c++ -O3 -std=c++17 -mavx512f -mavx512bw -mavx512vl -mavx512vnni -mfma -pthread \
//       scripts/lab/q4k_integer_sums.cpp -o /tmp/q4k_integer_sums && /tmp/q4k_integer_sums [threads] [layers]
//
// A chain of K x N layers (1536 x 8960, alternating) with random codes, 6-bit sc and m and float d, dmin per column
// and super-block of 8 blocks, packed as mirrorsd's super-block layout (16 columns per group: d, dmin, sc[8][16],
// m[8][16], then 8 blocks of 16 x 32 four-bit codes), multiplied by one row of int8 activations. Two inner loops:
//   float  what devices/kernels/src/gemm_avx512.cpp does today: per block, activation scale per 32, the block's
//          scale and offset rebuilt in float (convert, multiply, divide, subtract, multiply), two fmas;
//   int    activation scale per 256: per block, the int32 dot product times sc (vpmulld) and the activation block
//          sum times m, both added in int32 across the 8 blocks; two float steps per super-block (as llama.cpp's
//          Q4_K x Q8_K dot product does).
// They compute different numbers (the point is the cost); the output checksum is printed only so that the work is
// not optimized away. Two floors of the same stream: the unpacking and dot products alone, and the loads alone.
// Prints the median ms per chain pass of each (15 passes, alternated).
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

namespace {

constexpr int W = 16, B = 8, BLOCK = 32;
constexpr int HEAD = 2 * W * 4 + 2 * B * W;     // d, dmin, sc, m
constexpr int STRIDE = HEAD + B * W * BLOCK / 2;  // one super-block of one group

struct Layer {
  int K, N;
  std::vector<uint8_t, std::allocator<uint8_t>> packed;  // groups x supers x STRIDE
  uint8_t* data;
};

inline __m512i bcast4(const int8_t* q) {
  int32_t v;
  std::memcpy(&v, q, 4);
  return _mm512_set1_epi32(v);
}

inline __m512 bytes_as_floats(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

inline void load_block(const uint8_t* p, __m512i w[8]) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int v = 0; v < 4; ++v) {
    const __m512i packed = _mm512_loadu_si512(p + 64 * v);
    w[v] = _mm512_and_si512(packed, low);
    w[v + 4] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low);
  }
}

// today's numerics: per-32 activation scales ascale[blk], qsum[blk]
void gemv_float(const Layer& L, const int8_t* q, const float* ascale, const float* qsum, const int32_t* corr, int g0,
                int g1, float* y) {
  const int supers = L.K / 256;
  const __m512 center = _mm512_set1_ps(8.0f), zero = _mm512_setzero_ps();
  for (int g = g0; g < g1; ++g) {
    const uint8_t* p = L.data + static_cast<size_t>(g) * supers * STRIDE;
    __m512 acc = _mm512_setzero_ps();
    for (int t = 0; t < supers; ++t, p += STRIDE) {
      const __m512 d = _mm512_loadu_ps(reinterpret_cast<const float*>(p));
      const __m512 dmin = _mm512_loadu_ps(reinterpret_cast<const float*>(p) + W);
      for (int j = 0; j < B; ++j) {
        _mm_prefetch(reinterpret_cast<const char*>(p + 3072 + j * 320), _MM_HINT_T1);
        const int blk = t * B + j;
        __m512i w[8];
        load_block(p + HEAD + j * (W * BLOCK / 2), w);
        __m512i dot[4] = {_mm512_set1_epi32(corr[blk]), _mm512_setzero_si512(), _mm512_setzero_si512(),
                          _mm512_setzero_si512()};
        for (int v = 0; v < 8; ++v) dot[v % 4] = _mm512_dpbusd_epi32(dot[v % 4], w[v], bcast4(q + blk * 32 + 4 * v));
        const __m512i sum = _mm512_add_epi32(_mm512_add_epi32(dot[0], dot[1]), _mm512_add_epi32(dot[2], dot[3]));
        const __m512 wscale = _mm512_mul_ps(bytes_as_floats(p + 2 * W * 4 + j * W), d);
        const __m512 mins = _mm512_mul_ps(bytes_as_floats(p + 2 * W * 4 + (B + j) * W), dmin);
        const __m512 zp = _mm512_maskz_div_ps(_mm512_cmp_ps_mask(wscale, zero, _CMP_NEQ_UQ), mins, wscale);
        const __m512 offsets = _mm512_mul_ps(_mm512_sub_ps(center, zp), wscale);
        const __m512 as = _mm512_set1_ps(ascale[blk]);
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(wscale, as), acc);
        acc = _mm512_fmadd_ps(_mm512_set1_ps(qsum[blk]), _mm512_mul_ps(offsets, as), acc);
      }
    }
    _mm512_storeu_ps(y + g * W, acc);
  }
}

// integer sums across the super-block: per-256 activation scale ascale256[t], per-block int qsum
void gemv_int(const Layer& L, const int8_t* q, const float* ascale256, const int32_t* qsum_i, int g0, int g1,
              float* y) {
  const int supers = L.K / 256;
  for (int g = g0; g < g1; ++g) {
    const uint8_t* p = L.data + static_cast<size_t>(g) * supers * STRIDE;
    __m512 acc = _mm512_setzero_ps();
    for (int t = 0; t < supers; ++t, p += STRIDE) {
      const __m512 d = _mm512_loadu_ps(reinterpret_cast<const float*>(p));
      const __m512 dmin = _mm512_loadu_ps(reinterpret_cast<const float*>(p) + W);
      __m512i isum = _mm512_setzero_si512(), msum = _mm512_setzero_si512();
      for (int j = 0; j < B; ++j) {
        _mm_prefetch(reinterpret_cast<const char*>(p + 3072 + j * 320), _MM_HINT_T1);
        const int blk = t * B + j;
        __m512i w[8];
        load_block(p + HEAD + j * (W * BLOCK / 2), w);
        __m512i dot[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
        for (int v = 0; v < 8; ++v) dot[v % 2] = _mm512_dpbusd_epi32(dot[v % 2], w[v], bcast4(q + blk * 32 + 4 * v));
        const __m512i sc = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2 * W * 4 + j * W)));
        const __m512i m = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2 * W * 4 + (B + j) * W)));
        isum = _mm512_add_epi32(isum, _mm512_mullo_epi32(_mm512_add_epi32(dot[0], dot[1]), sc));
        msum = _mm512_add_epi32(msum, _mm512_mullo_epi32(m, _mm512_set1_epi32(qsum_i[blk])));
      }
      const __m512 as = _mm512_set1_ps(ascale256[t]);
      acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(d, as), acc);
      acc = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(msum), _mm512_mul_ps(dmin, as), acc);
    }
    _mm512_storeu_ps(y + g * W, acc);
  }
}

// the floor of the same stream: only the unpacking and the dot products (what both loops share), or only the loads
void gemv_dots(const Layer& L, const int8_t* q, int g0, int g1, float* y, bool dots) {
  const int supers = L.K / 256;
  for (int g = g0; g < g1; ++g) {
    const uint8_t* p = L.data + static_cast<size_t>(g) * supers * STRIDE;
    __m512i acc = _mm512_setzero_si512();
    for (int t = 0; t < supers; ++t, p += STRIDE)
      for (int j = 0; j < B; ++j) {
        _mm_prefetch(reinterpret_cast<const char*>(p + 3072 + j * 320), _MM_HINT_T1);
        const uint8_t* block = p + HEAD + j * (W * BLOCK / 2);
        if (!dots) {
          for (int v = 0; v < 4; ++v) acc = _mm512_xor_si512(acc, _mm512_loadu_si512(block + 64 * v));
          continue;
        }
        __m512i w[8];
        load_block(block, w);
        for (int v = 0; v < 8; ++v) acc = _mm512_dpbusd_epi32(acc, w[v], bcast4(q + (t * B + j) * 32 + 4 * v));
      }
    _mm512_storeu_ps(y + g * W, _mm512_cvtepi32_ps(acc));
  }
}

}  // namespace

int main(int argc, char** argv) {
  const int threads = argc > 1 ? std::atoi(argv[1]) : 2, layers_n = argc > 2 ? std::atoi(argv[2]) : 40;
  std::mt19937 rng(1);
  std::vector<Layer> layers;
  size_t bytes = 0;
  for (int i = 0; i < layers_n; ++i) {
    Layer L;
    L.K = i % 2 == 0 ? 1536 : 8960, L.N = i % 2 == 0 ? 8960 : 1536;
    const size_t n = static_cast<size_t>(L.N / W) * (L.K / 256) * STRIDE;
    L.data = static_cast<uint8_t*>(std::aligned_alloc(64, (n + 63) / 64 * 64));
    for (size_t k = 0; k < n; ++k) L.data[k] = static_cast<uint8_t>(rng());
    for (int g = 0; g < L.N / W; ++g)  // sane d and dmin
      for (int t = 0; t < L.K / 256; ++t) {
        float* f = reinterpret_cast<float*>(L.data + (static_cast<size_t>(g) * (L.K / 256) + t) * STRIDE);
        for (int c = 0; c < 2 * W; ++c) f[c] = 1e-4f * (1 + c % 7);
      }
    bytes += n;
    layers.push_back(std::move(L));
  }
  const int kmax = 8960;
  std::vector<int8_t> q(kmax);
  for (auto& v : q) v = static_cast<int8_t>(static_cast<int>(rng() % 255) - 127);
  std::vector<float> ascale(kmax / 32, 0.01f), qsum(kmax / 32, 3.0f), ascale256(kmax / 256, 0.01f);
  std::vector<int32_t> corr(kmax / 32, -24), qsum_i(kmax / 32, 3);
  std::vector<float> y(kmax);
  auto pass = [&](int kind) {  // 0 float, 1 int, 2 dots only, 3 loads only
    for (const Layer& L : layers) {
      const int groups = L.N / W;
      std::vector<std::thread> pool;
      for (int th = 0; th < threads; ++th) {
        const int g0 = groups * th / threads, g1 = groups * (th + 1) / threads;
        pool.emplace_back([&, g0, g1] {
          if (kind == 1) gemv_int(L, q.data(), ascale256.data(), qsum_i.data(), g0, g1, y.data());
          else if (kind == 0) gemv_float(L, q.data(), ascale.data(), qsum.data(), corr.data(), g0, g1, y.data());
          else gemv_dots(L, q.data(), g0, g1, y.data(), kind == 2);
        });
      }
      for (auto& t : pool) t.join();
    }
  };
  const char* names[4] = {"float sums per block (today's loop)", "integer sums per super-block",
                           "unpacking and dot products only", "loads only"};
  std::vector<double> times[4];
  for (int r = 0; r < 15; ++r)
    for (int i = 0; i < 4; ++i) {
      const int kind = (r % 2 == 0) ? i : 3 - i;  // alternated order
      const auto start = std::chrono::steady_clock::now();
      pass(kind);
      times[kind].push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
    }
  double check = 0;
  for (float v : y) check += v;
  std::printf("%d layers, %.0f MB in super-blocks, %d threads (a thread per layer call: includes thread start-up)\n",
              layers_n, bytes / 1e6, threads);
  for (int i = 0; i < 4; ++i) {
    std::sort(times[i].begin(), times[i].end());
    std::printf("%-40s %6.2f ms (%.1f GB/s)\n", names[i], times[i][7], bytes / times[i][7] / 1e6);
  }
  std::printf("(checksum %g)\n", check);
  return 0;
}
