// FP8 quantization (1x128 tiles, 128x128 blocks) and the reference FP8 GEMM; the rules are in
// fp8.hpp. Every group is produced by one task from its own inputs, so results are bitwise
// independent of the thread count.
#include "core/fp8.hpp"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/parallel.hpp"
#include "moeblaze/error.hpp"

namespace moeblaze {
namespace {

inline float widen(float v) { return v; }
inline float widen(bf16 v) { return static_cast<float>(v); }

void check_dims(const char* what, int64_t rows, int64_t cols, int64_t ld) {
  MOEBLAZE_REQUIRE(rows >= 0 && cols >= 0, what, ": rows (", rows, ") and cols (", cols,
                   ") must be >= 0");
  MOEBLAZE_REQUIRE(ld >= cols, what, ": ld (", ld, ") must be >= cols (", cols, ")");
}

// amax of rows [r0, r1) x columns [c0, c1); NaN as soon as one element is NaN.
template <typename T>
float group_amax(const T* x, int64_t ld, int64_t r0, int64_t r1, int64_t c0, int64_t c1) {
  float amax = 0.0f;
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t c = c0; c < c1; ++c) {
      const float v = std::fabs(widen(x[r * ld + c]));
      if (std::isnan(v)) return v;
      if (v > amax) amax = v;
    }
  return amax;
}

// Codes of rows [r0, r1) x columns [c0, c1) under one scale.
template <typename T>
void quantize_group(const T* x, int64_t ld, int64_t r0, int64_t r1, int64_t c0, int64_t c1,
                    float scale, e4m3* q, int64_t ldq) {
  if (std::isnan(scale)) {
    for (int64_t r = r0; r < r1; ++r)
      std::fill(q + r * ldq + c0, q + r * ldq + c1, e4m3::from_bits(kE4m3NaN));
    return;
  }
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t c = c0; c < c1; ++c)
      q[r * ldq + c].bits = e4m3::from_float(widen(x[r * ld + c]) / scale);
}

template <typename T>
void quantize_1x128_impl(const T* x, int64_t rows, int64_t cols, int64_t ld, e4m3* q,
                         float* scales) {
  check_dims("quantize_1x128", rows, cols, ld);
  const int64_t kb = fp8_groups(cols);
  parallel_for(0, rows, 16, [&](int64_t r) {
    for (int64_t g = 0; g < kb; ++g) {
      const int64_t c0 = g * kFp8Group, c1 = std::min(cols, c0 + kFp8Group);
      const float scale = fp8_scale(group_amax(x, ld, r, r + 1, c0, c1));
      scales[r * kb + g] = scale;
      quantize_group(x, ld, r, r + 1, c0, c1, scale, q, cols);
    }
  });
}

template <typename T>
void quantize_128x128_impl(const T* x, int64_t rows, int64_t cols, int64_t ld, e4m3* q,
                           float* scales) {
  check_dims("quantize_128x128", rows, cols, ld);
  const int64_t rb = fp8_groups(rows), cb = fp8_groups(cols);
  parallel_for(0, rb * cb, 1, [&](int64_t blk) {
    const int64_t i = blk / cb, j = blk % cb;
    const int64_t r0 = i * kFp8Group, r1 = std::min(rows, r0 + kFp8Group);
    const int64_t c0 = j * kFp8Group, c1 = std::min(cols, c0 + kFp8Group);
    const float scale = fp8_scale(group_amax(x, ld, r0, r1, c0, c1));
    scales[blk] = scale;
    quantize_group(x, ld, r0, r1, c0, c1, scale, q, cols);
  });
}

}  // namespace

void quantize_1x128(const float* x, int64_t rows, int64_t cols, int64_t ld, e4m3* q,
                    float* scales) {
  quantize_1x128_impl(x, rows, cols, ld, q, scales);
}
void quantize_1x128(const bf16* x, int64_t rows, int64_t cols, int64_t ld, e4m3* q,
                    float* scales) {
  quantize_1x128_impl(x, rows, cols, ld, q, scales);
}
void quantize_128x128(const float* x, int64_t rows, int64_t cols, int64_t ld, e4m3* q,
                      float* scales) {
  quantize_128x128_impl(x, rows, cols, ld, q, scales);
}
void quantize_128x128(const bf16* x, int64_t rows, int64_t cols, int64_t ld, e4m3* q,
                      float* scales) {
  quantize_128x128_impl(x, rows, cols, ld, q, scales);
}

void fake_quantize_group(float* x, int64_t ld, int64_t r0, int64_t r1, int64_t c0, int64_t c1) {
  const float scale = fp8_scale(group_amax(x, ld, r0, r1, c0, c1));
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t c = c0; c < c1; ++c) {
      float& v = x[r * ld + c];
      // A NaN scale turns every value NaN, as quantize_group's all-NaN codes dequantize.
      v = std::isnan(scale) ? scale : e4m3::to_float(e4m3::from_float(v / scale)) * scale;
    }
}

void dequantize_1x128(const e4m3* q, const float* scales, int64_t rows, int64_t cols, float* x) {
  check_dims("dequantize_1x128", rows, cols, cols);
  const int64_t kb = fp8_groups(cols);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c)
      x[r * cols + c] = static_cast<float>(q[r * cols + c]) * scales[r * kb + c / kFp8Group];
}

void dequantize_128x128(const e4m3* q, const float* scales, int64_t rows, int64_t cols,
                        float* x) {
  check_dims("dequantize_128x128", rows, cols, cols);
  const int64_t cb = fp8_groups(cols);
  for (int64_t r = 0; r < rows; ++r) {
    const float* srow = scales + (r / kFp8Group) * cb;
    for (int64_t c = 0; c < cols; ++c)
      x[r * cols + c] = static_cast<float>(q[r * cols + c]) * srow[c / kFp8Group];
  }
}

void gemm_fp8_reference(int64_t M, int64_t N, int64_t K, const e4m3* a, const float* a_scales,
                        const e4m3* b, const float* b_scales, float* c) {
  MOEBLAZE_REQUIRE(M >= 0 && N >= 0 && K >= 0, "gemm_fp8_reference: M (", M, "), N (", N,
                   ") and K (", K, ") must be >= 0");
  const int64_t KB = fp8_groups(K);
  // Decoded once: the codes' values are exact in fp32, and B transposed (K, N) lets the block
  // sums of a row of C run as independent lanes over n, each still in ascending k.
  std::vector<float> af(static_cast<size_t>(M * K));   // (M, K) fp32 values of A's codes
  std::vector<float> bt(static_cast<size_t>(K * N));   // (K, N) fp32 values of B's codes, transposed
  for (int64_t i = 0; i < M * K; ++i) af[i] = static_cast<float>(a[i]);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k) bt[k * N + n] = static_cast<float>(b[n * K + k]);

  parallel_for(0, M, 4, [&](int64_t m) {
    float* crow = c + m * N;  // (N,) the fp32 accumulators of row m
    std::fill(crow, crow + N, 0.0f);
    std::vector<float> s(static_cast<size_t>(std::min<int64_t>(N, kFp8Group)));  // (<=128,) block sums
    for (int64_t kb = 0; kb < KB; ++kb) {
      const int64_t k0 = kb * kFp8Group, k1 = std::min(K, k0 + kFp8Group);
      const float sa = a_scales[m * KB + kb];
      for (int64_t n0 = 0; n0 < N; n0 += kFp8Group) {
        const int64_t nn = std::min(kFp8Group, N - n0);
        std::fill(s.begin(), s.begin() + nn, 0.0f);
        for (int64_t k = k0; k < k1; ++k) {
          const float av = af[m * K + k];
          const float* brow = bt.data() + k * N + n0;
          for (int64_t j = 0; j < nn; ++j) s[j] += av * brow[j];  // exact product, one rounding
        }
        const float scale = sa * b_scales[(n0 / kFp8Group) * KB + kb];
        for (int64_t j = 0; j < nn; ++j) crow[n0 + j] = std::fma(s[j], scale, crow[n0 + j]);
      }
    }
  });
}

}  // namespace moeblaze
