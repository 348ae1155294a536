// FP8 numerics of the FP8 compute path (docs/FP8.md): the e4m3 storage type, the fine-grained scale
// rule (1x128 tiles along K for activations and gradients, 128x128 blocks for weights) and a
// reference FP8 GEMM with FP32 promotion every 128 elements of K. The GPU kernels reproduce the
// quantized bytes and scales bit for bit, so every rule below is written in IEEE fp32 operations
// and the cvt.rn.satfinite.e4m3x2.f32 conversion. Why these rules:
// docs/notes/fp8.md.
//
// The rules (GPU kernels must follow them exactly):
//  e4m3      OCP FP8 E4M3FN: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinities;
//            0x7F / 0xFF are NaN; largest finite 448 (0x7E), smallest subnormal 2^-9 (0x01).
//  from_float  = cvt.rn.satfinite.e4m3x2.f32 (PTX ISA .satfinite: a NaN input gives NaN,
//            |input| > MAX_NORM gives sign-preserved MAX_NORM): round to nearest, ties to even
//            mantissa; finite |x| >= 448 and +-Inf give +-448; NaN gives 0x7F (the canonical
//            NaN, as CUDA's cuda_fp8.hpp host conversion gives); +-0 and underflow keep the sign.
//  to_float  exact (every e4m3 value is an fp32 value); 0x7F / 0xFF give a quiet NaN.
//  group     a 1x128 tile (128 consecutive elements of a row) or a 128x128 block; partial at the
//            right and bottom edges (fewer elements, same rule).
//  amax      max |x| over the group in fp32 (bf16 inputs widened exactly first); NaN when any
//            element is NaN (on the GPU: max.NaN.f32, not fmaxf, which drops NaN).
//  scale     fp8_scale(amax):  NaN (bits kFp8NaNScaleBits) when amax is NaN or Inf;
//                              1.0f when amax == 0;
//                              max(amax, kFp8MinAmax) / 448.0f otherwise (IEEE fp32 division).
//  codes     finite scale: q = from_float(x / scale) (IEEE fp32 division, not x * (1/scale));
//            NaN scale: every code of the group is 0x7F, so the group dequantizes to NaN and
//            every GEMM output it touches is NaN (the layer rejects NaN/Inf inputs upstream;
//            this keeps a missed one visible instead of saturating it to +-448 silently).
//  dequant   float(q) * scale (fp32 multiplication).
//  GEMM      C (M, N) = A (M, K) · Bᵀ (N, K), A in 1x128 tiles, B in 128x128 blocks; see
//            gemm_fp8_reference for the order.
// The GPU side must compile these steps without fast-math (no -ftz, IEEE div.rn.f32).
#pragma once

#include <cstdint>
#include <cstring>

#include "moeblaze/dtype.hpp"

namespace moeblaze {

// OCP FP8 E4M3FN storage. Arithmetic is always done in float.
struct e4m3 {
  uint8_t bits = 0;

  e4m3() = default;
  explicit e4m3(float f) : bits(from_float(f)) {}
  operator float() const { return to_float(bits); }
  static e4m3 from_bits(uint8_t b) {
    e4m3 v;
    v.bits = b;
    return v;
  }

  // Round to nearest even, saturating to +-448 (cvt.rn.satfinite.e4m3x2.f32).
  static uint8_t from_float(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
    const uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return 0x7f;                 // NaN: the canonical e4m3 NaN
    if (a >= 0x43e00000u) return sign | 0x7e;         // |f| >= 448 or Inf: satfinite
    if (a >= 0x3c800000u) {                           // |f| >= 2^-6: e4m3 normal range
      // RNE at fp32 mantissa bit 20; a carry moves into the exponent as it should.
      const uint32_t r = a + 0x7ffffu + ((a >> 20) & 1u);
      return sign | static_cast<uint8_t>((r >> 20) - (120u << 3));  // exponent bias 127 -> 7
    }
    const uint32_t e = a >> 23;
    if (e < 117) return sign;                         // |f| < 2^-10: rounds to zero
    // Subnormal grid of 2^-9: |f| / 2^-9 = mantissa >> (141 - e), rounded to nearest even.
    const uint32_t shift = 141 - e;                   // 21..24
    const uint32_t mant = (a & 0x7fffffu) | 0x800000u;
    uint32_t q = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1u), half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (q & 1u))) ++q;  // q == 8 is 2^-6, the first normal
    return sign | static_cast<uint8_t>(q);
  }

  static float to_float(uint8_t b) {
    const uint32_t sign = static_cast<uint32_t>(b & 0x80u) << 24;
    const uint32_t mag = b & 0x7fu;
    uint32_t u;
    if (mag == 0x7fu) {
      u = sign | 0x7fc00000u;  // NaN
    } else if (mag >= 0x08u) {
      u = sign | ((mag + (120u << 3)) << 20);  // normal: exponent bias 7 -> 127
    } else {
      const float f = static_cast<float>(mag) * 0x1p-9f;  // subnormal: mag * 2^-9, exact
      std::memcpy(&u, &f, 4);
      u |= sign;
    }
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
};
static_assert(sizeof(e4m3) == 1, "e4m3 must be one byte");

inline constexpr float kE4m3Max = 448.0f;
inline constexpr uint8_t kE4m3NaN = 0x7f;
// Tile / block edge of the fine-grained scaling, and the K span between FP32 promotions.
inline constexpr int64_t kFp8Group = 128;
// Smallest amax taken at face value: 448 * 2^-126, so every scale is a normal fp32 (>= 2^-126),
// never a zero or subnormal one that x / scale would overflow against.
inline constexpr float kFp8MinAmax = 0x1.cp-118f;
// The NaN scale of a group holding NaN or Inf (fp32 quiet NaN, positive).
inline constexpr uint32_t kFp8NaNScaleBits = 0x7fc00000u;

inline int64_t fp8_groups(int64_t n) { return (n + kFp8Group - 1) / kFp8Group; }

// The scale rule, one definition for every tile and block (header comment).
inline float fp8_scale(float amax) {
  if (!(amax <= 3.40282347e38f)) {  // NaN or Inf
    float s;
    std::memcpy(&s, &kFp8NaNScaleBits, 4);
    return s;
  }
  if (amax == 0.0f) return 1.0f;
  return (amax > kFp8MinAmax ? amax : kFp8MinAmax) / kE4m3Max;
}

// 1x128 tiles: each run of 128 consecutive elements of a row (along K for row-major activations
// and gradients) shares one scale. x is (rows, cols) with row stride ld >= cols.
void quantize_1x128(const float* x, int64_t rows, int64_t cols, int64_t ld,
                    e4m3* q /*(rows, cols)*/, float* scales /*(rows, ceil(cols/128))*/);
void quantize_1x128(const bf16* x, int64_t rows, int64_t cols, int64_t ld,
                    e4m3* q /*(rows, cols)*/, float* scales /*(rows, ceil(cols/128))*/);
void dequantize_1x128(const e4m3* q /*(rows, cols)*/, const float* scales /*(rows, ceil(cols/128))*/,
                      int64_t rows, int64_t cols, float* x /*(rows, cols)*/);

// 128x128 blocks (weights): each block of up to 128 rows x 128 columns shares one scale.
void quantize_128x128(const float* x, int64_t rows, int64_t cols, int64_t ld,
                      e4m3* q /*(rows, cols)*/,
                      float* scales /*(ceil(rows/128), ceil(cols/128))*/);
void quantize_128x128(const bf16* x, int64_t rows, int64_t cols, int64_t ld,
                      e4m3* q /*(rows, cols)*/,
                      float* scales /*(ceil(rows/128), ceil(cols/128))*/);
void dequantize_128x128(const e4m3* q /*(rows, cols)*/,
                        const float* scales /*(ceil(rows/128), ceil(cols/128))*/, int64_t rows,
                        int64_t cols, float* x /*(rows, cols)*/);

// The rule applied in place: rows [r0, r1) x columns [c0, c1) of x (fp32, row stride ld), one
// group, become the values their codes and scale stand for, float(code) * scale — what
// dequantizing quantize_*'s output gives, without storing the codes (the CPU backend's FP8
// operands).
void fake_quantize_group(float* x, int64_t ld, int64_t r0, int64_t r1, int64_t c0, int64_t c1);

// Reference FP8 GEMM, C = A · Bᵀ with A in 1x128 tiles along K and B in 128x128 blocks, in the
// order of the GPU recipe. For each (m, n), with KB = ceil(K/128):
//   acc = 0
//   for kb in 0 .. KB-1:                                  ascending
//     s = 0;  for k in [128 kb, min(K, 128 kb + 128)):  s = s + float(a[m,k]) * float(b[n,k])
//             (fp32, ascending k; each product of two e4m3 values is exact in fp32)
//     acc = fmaf(s, a_scales[m,kb] * b_scales[n/128,kb], acc)   (scale product rounded first)
//   c[m,n] = acc
// Tensor cores sum a block's products in their own order and internal precision, which the CPU
// cannot reproduce bit for bit: GPU-vs-CPU GEMM results compare within a tolerance, while the
// quantized bytes and scales feeding them compare bit-exactly. Rows run in parallel; the result
// does not depend on the thread count.
void gemm_fp8_reference(int64_t M, int64_t N, int64_t K, const e4m3* a /*(M, K)*/,
                        const float* a_scales /*(M, ceil(K/128))*/, const e4m3* b /*(N, K)*/,
                        const float* b_scales /*(ceil(N/128), ceil(K/128))*/,
                        float* c /*(M, N)*/);

}  // namespace moeblaze
