// FP8 numerics (src/core/fp8.hpp): e4m3 conversion against an independent nearest-value
// reference, the 1x128 / 128x128 quantizers (scales bit-exact, error within half an e4m3 ulp),
// and the reference FP8 GEMM against float64 GEMMs of the dequantized and of the original inputs.
// The DISABLED_ tests are one-off measurements (all 2^32 floats; the error table of
// docs/notes/fp8.md): --gtest_also_run_disabled_tests.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cfloat>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "common/test_util.hpp"
#include "core/fp8.hpp"
#include "core/parallel.hpp"

namespace moeblaze {
namespace {

using test::bits_of;
using test::float_of;
using test::printed_seed;

bool is_nan_code(uint8_t b) { return (b & 0x7f) == 0x7f; }

// ---- the independent e4m3 reference -------------------------------------------------------

// The 127 finite non-negative e4m3 values by code, from the format's definition in double.
const std::vector<double>& e4m3_values() {
  static const std::vector<double> v = [] {
    std::vector<double> t;
    for (int code = 0; code < 0x7f; ++code) {
      const int e = code >> 3, m = code & 7;
      t.push_back(e == 0 ? std::ldexp(m / 8.0, -6) : std::ldexp(1.0 + m / 8.0, e - 7));
    }
    return t;
  }();
  return v;
}

// Nearest finite e4m3 value (ties to the even code, i.e. even mantissa), saturating above 448,
// sign kept; NaN gives 0x7F. The two candidates' midpoint is exact in double, so comparing
// against it decides the nearest without rounding.
uint8_t reference_e4m3(float f) {
  if (std::isnan(f)) return 0x7f;
  const uint8_t sign = std::signbit(f) ? 0x80 : 0x00;
  const double a = std::fabs(static_cast<double>(f));
  const std::vector<double>& t = e4m3_values();
  if (a >= 448.0) return sign | 0x7e;
  const int hi = static_cast<int>(std::upper_bound(t.begin(), t.end(), a) - t.begin());  // t[hi] > a
  const int lo = hi - 1;                                                                 // t[lo] <= a
  const double mid = 0.5 * (t[lo] + t[hi]);
  int code;
  if (a < mid) code = lo;
  else if (a > mid) code = hi;
  else code = (lo % 2 == 0) ? lo : hi;
  return sign | static_cast<uint8_t>(code);
}

// Half an e4m3 ulp at magnitude v (in the units of the e4m3 value, i.e. x / scale).
double e4m3_half_ulp(double v) {
  if (v < 0x1p-6) return 0x1p-10;
  return std::ldexp(1.0, static_cast<int>(std::floor(std::log2(v))) - 4);
}

// ---- e4m3 conversion -----------------------------------------------------------------------

TEST(Fp8E4m3, AllCodesRoundTrip) {
  for (int code = 0; code < 256; ++code) {
    const uint8_t b = static_cast<uint8_t>(code);
    const float f = e4m3::to_float(b);
    SCOPED_TRACE("code " + std::to_string(code));
    if (is_nan_code(b)) {
      EXPECT_TRUE(std::isnan(f));
      EXPECT_TRUE(is_nan_code(e4m3::from_float(f)));
      continue;
    }
    const double expect = (code & 0x80 ? -1.0 : 1.0) * e4m3_values()[code & 0x7f];
    EXPECT_EQ(static_cast<double>(f), expect);
    EXPECT_EQ(std::signbit(f), (code & 0x80) != 0);
    EXPECT_EQ(e4m3::from_float(f), b);
    EXPECT_EQ(float(e4m3(f)), f);
  }
  EXPECT_EQ(e4m3::to_float(0x7e), 448.0f);
  EXPECT_EQ(e4m3::to_float(0x01), 0x1p-9f);
  EXPECT_EQ(e4m3::to_float(0x08), 0x1p-6f);
  EXPECT_EQ(e4m3::to_float(0x38), 1.0f);
}

TEST(Fp8E4m3, EdgeCases) {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  // Saturation: 448 and above (464 = the midpoint to the next, unrepresentable 480), Inf.
  for (float f : {448.0f, std::nextafter(448.0f, inf), 464.0f, std::nextafter(464.0f, 0.0f),
                  std::nextafter(464.0f, inf), 480.0f, 512.0f, 1e30f, FLT_MAX, inf}) {
    EXPECT_EQ(e4m3::from_float(f), 0x7e) << f;
    EXPECT_EQ(e4m3::from_float(-f), 0xfe) << -f;
  }
  EXPECT_EQ(e4m3::from_float(std::nextafter(448.0f, 0.0f)), 0x7e);  // rounds to 448
  EXPECT_EQ(e4m3::from_float(432.0f), 0x7e);                         // 416|448 tie: 448 is even
  EXPECT_EQ(e4m3::from_float(std::nextafter(432.0f, 0.0f)), 0x7d);   // 416
  // NaN (either sign, any payload) gives the canonical NaN 0x7F.
  EXPECT_EQ(e4m3::from_float(nan), 0x7f);
  EXPECT_EQ(e4m3::from_float(-nan), 0x7f);
  EXPECT_EQ(e4m3::from_float(float_of(0x7f800001u)), 0x7f);
  EXPECT_EQ(e4m3::from_float(float_of(0xffbfffffu)), 0x7f);
  // Zeros keep their sign; underflow too.
  EXPECT_EQ(e4m3::from_float(0.0f), 0x00);
  EXPECT_EQ(e4m3::from_float(-0.0f), 0x80);
  EXPECT_EQ(e4m3::from_float(-1e-30f), 0x80);
  EXPECT_EQ(e4m3::from_float(float_of(1u)), 0x00);  // smallest fp32 subnormal
  // Subnormal range: 2^-10 ties to 0 (even), just above goes to 2^-9; 3*2^-10 ties to 2*2^-9.
  EXPECT_EQ(e4m3::from_float(0x1p-10f), 0x00);
  EXPECT_EQ(e4m3::from_float(std::nextafter(0x1p-10f, 1.0f)), 0x01);
  EXPECT_EQ(e4m3::from_float(3 * 0x1p-10f), 0x02);
  EXPECT_EQ(e4m3::from_float(15 * 0x1p-10f), 0x08);  // 7.5 * 2^-9 ties to 8 * 2^-9 = 2^-6
  EXPECT_EQ(e4m3::from_float(std::nextafter(0x1p-6f, 0.0f)), 0x08);
  // Normal ties: 1 + 1/16 goes to 1 (even), 1 + 3/16 to 1.25 (even).
  EXPECT_EQ(e4m3::from_float(1.0625f), 0x38);
  EXPECT_EQ(e4m3::from_float(1.1875f), 0x3a);

  // Every code's value, the midpoints between consecutive codes, and their fp32 neighbours.
  const std::vector<double>& t = e4m3_values();
  std::vector<float> probes;
  for (size_t i = 0; i < t.size(); ++i) {
    const float v = static_cast<float>(t[i]);
    probes.insert(probes.end(), {v, std::nextafter(v, 0.0f), std::nextafter(v, inf)});
    if (i + 1 < t.size()) {
      const float mid = static_cast<float>(0.5 * (t[i] + t[i + 1]));
      EXPECT_EQ(static_cast<double>(mid), 0.5 * (t[i] + t[i + 1]));  // exact in fp32
      probes.insert(probes.end(), {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, inf)});
    }
  }
  for (int k = 0; k <= 64; ++k) probes.push_back(std::ldexp(static_cast<float>(k), -11));
  probes.insert(probes.end(), {FLT_MIN, FLT_TRUE_MIN, 0x1p-7f, 0x1p-11f, 1e-3f, 3.0f, 240.0f});
  for (float p : probes) {
    EXPECT_EQ(e4m3::from_float(p), reference_e4m3(p)) << p;
    EXPECT_EQ(e4m3::from_float(-p), reference_e4m3(-p)) << -p;
  }
}

TEST(Fp8E4m3, RandomFloatsMatchReference) {
  const uint64_t seed = printed_seed("RandomFloatsMatchReference");
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  int64_t mismatches = 0;
  auto check = [&](float f) {
    if (e4m3::from_float(f) != reference_e4m3(f) && ++mismatches <= 10)
      ADD_FAILURE() << "from_float(" << f << " = 0x" << std::hex << bits_of(f) << ") = 0x"
                    << int(e4m3::from_float(f)) << ", reference 0x" << int(reference_e4m3(f));
  };
  // Any bit pattern (every exponent, NaN, Inf, subnormals) ...
  for (int i = 0; i < 1000000; ++i) check(float_of(static_cast<uint32_t>(rng())));
  // ... and patterns whose exponent lies in or around e4m3's range (2^-13 .. 2^10).
  for (int i = 0; i < 2000000; ++i) {
    const uint32_t r = static_cast<uint32_t>(rng());
    const uint32_t e = 114 + (r >> 27) % 24;
    check(float_of((r & 0x807fffffu) | (e << 23)));
  }
  EXPECT_EQ(mismatches, 0);
}

// All 2^32 floats (about 20 s on two cores).
TEST(Fp8E4m3, DISABLED_AllFloatsMatchReference) {
  std::atomic<int64_t> mismatches{0};
  parallel_for(0, int64_t(1) << 16, 1, [&](int64_t hi) {
    for (uint32_t lo = 0; lo < (1u << 16); ++lo) {
      const float f = float_of(static_cast<uint32_t>(hi << 16) | lo);
      if (e4m3::from_float(f) != reference_e4m3(f)) ++mismatches;
    }
  });
  EXPECT_EQ(mismatches.load(), 0);
}

// ---- quantization --------------------------------------------------------------------------

// The scale rule written out once more, plainly: NaN for NaN/Inf, 1 for zero, else
// max(amax, 448 * 2^-126) / 448.
template <typename T>
float recomputed_scale(const T* x, int64_t ld, int64_t r0, int64_t r1, int64_t c0, int64_t c1) {
  float amax = 0.0f;
  bool nan = false;
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t c = c0; c < c1; ++c) {
      const float v = static_cast<float>(x[r * ld + c]);
      nan = nan || std::isnan(v);
      amax = std::max(amax, std::fabs(v));
    }
  if (nan || std::isinf(amax)) return float_of(0x7fc00000u);
  if (amax == 0.0f) return 1.0f;
  return std::max(amax, std::ldexp(448.0f, -126)) / 448.0f;
}

// Test data: Gaussian with a random power-of-two magnitude per row (2^-20 .. 2^20) and a few
// large outliers, so that tiles and blocks get very different scales.
std::vector<float> spread_data(int64_t rows, int64_t cols, uint64_t seed) {
  std::vector<float> v = test::random_normal(static_cast<size_t>(rows * cols), seed);
  std::mt19937_64 rng(seed ^ 0x9e3779b97f4a7c15ull);
  for (int64_t r = 0; r < rows; ++r) {
    const float mag = std::ldexp(1.0f, static_cast<int>(rng() % 41) - 20);
    for (int64_t c = 0; c < cols; ++c) v[r * cols + c] *= mag;
  }
  for (size_t i = 0; i < v.size(); i += 997) v[i] *= 300.0f;
  return v;
}

// Checks q and scales of one group against the rule: the scale bit for bit, each code equal to
// from_float(x / scale), and the dequantized value within half an e4m3 ulp (times the scale).
template <typename T>
void check_group(const T* x, int64_t ld, int64_t r0, int64_t r1, int64_t c0, int64_t c1,
                 const e4m3* q, int64_t ldq, float scale, int64_t* checked) {
  const float expect = recomputed_scale(x, ld, r0, r1, c0, c1);
  ASSERT_EQ(bits_of(scale), bits_of(expect)) << "group rows " << r0 << ".." << r1 << " cols "
                                             << c0 << ".." << c1;
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t c = c0; c < c1; ++c) {
      const float xv = static_cast<float>(x[r * ld + c]);
      const uint8_t code = q[r * ldq + c].bits;
      if (std::isnan(scale)) {
        ASSERT_EQ(code, kE4m3NaN);
        continue;
      }
      ASSERT_EQ(code, e4m3::from_float(xv / scale)) << "x[" << r << ", " << c << "] = " << xv;
      // Exact dequantized value q * scale (4 x 24 bits) against x, in double; the slack covers
      // the fp32 rounding of x / scale before the e4m3 rounding.
      const double err = std::fabs(double(e4m3::to_float(code)) * double(scale) - double(xv));
      const double v = std::fabs(double(xv)) / double(scale);
      const double bound = e4m3_half_ulp(std::min(v, 448.0)) * double(scale) * (1 + 0x1p-20) +
                           std::max(0.0, std::fabs(double(xv)) - 448.0 * double(scale));
      ASSERT_LE(err, bound) << "x[" << r << ", " << c << "] = " << xv << " scale " << scale;
      ++*checked;
    }
}

template <typename T>
void check_1x128(const T* x, int64_t rows, int64_t cols, int64_t ld) {
  const int64_t kb = fp8_groups(cols);
  std::vector<e4m3> q(static_cast<size_t>(rows * cols));        // (rows, cols)
  std::vector<float> s(static_cast<size_t>(rows * kb), -1.0f);  // (rows, kb)
  quantize_1x128(x, rows, cols, ld, q.data(), s.data());
  int64_t checked = 0;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < kb; ++g)
      check_group(x, ld, r, r + 1, g * 128, std::min(cols, g * 128 + 128), q.data(), cols,
                  s[r * kb + g], &checked);
  std::vector<float> deq(static_cast<size_t>(rows * cols));  // (rows, cols)
  dequantize_1x128(q.data(), s.data(), rows, cols, deq.data());
  for (int64_t i = 0; i < rows * cols; ++i)
    ASSERT_EQ(bits_of(deq[i]), bits_of(float(q[i]) * s[(i / cols) * kb + (i % cols) / 128]));
}

template <typename T>
void check_128x128(const T* x, int64_t rows, int64_t cols, int64_t ld) {
  const int64_t rb = fp8_groups(rows), cb = fp8_groups(cols);
  std::vector<e4m3> q(static_cast<size_t>(rows * cols));        // (rows, cols)
  std::vector<float> s(static_cast<size_t>(rb * cb), -1.0f);    // (rb, cb)
  quantize_128x128(x, rows, cols, ld, q.data(), s.data());
  int64_t checked = 0;
  for (int64_t i = 0; i < rb; ++i)
    for (int64_t j = 0; j < cb; ++j)
      check_group(x, ld, i * 128, std::min(rows, i * 128 + 128), j * 128,
                  std::min(cols, j * 128 + 128), q.data(), cols, s[i * cb + j], &checked);
  std::vector<float> deq(static_cast<size_t>(rows * cols));  // (rows, cols)
  dequantize_128x128(q.data(), s.data(), rows, cols, deq.data());
  for (int64_t i = 0; i < rows * cols; ++i) {
    const int64_t r = i / cols, c = i % cols;
    ASSERT_EQ(bits_of(deq[i]), bits_of(float(q[i]) * s[(r / 128) * cb + c / 128]));
  }
}

TEST(Fp8Quantize, Tiles1x128RandomWithPartialEdges) {
  const uint64_t seed = printed_seed("Tiles1x128RandomWithPartialEdges");
  SCOPED_TRACE("seed " + std::to_string(seed));
  // cols 300 = 2 full tiles + 44; ld 310: a strided view.
  const int64_t rows = 37, cols = 300, ld = 310;
  const std::vector<float> x = spread_data(rows, ld, seed);
  check_1x128(x.data(), rows, cols, ld);
  check_1x128(x.data(), rows, 128, ld);  // exactly one tile
  check_1x128(x.data(), rows, 5, ld);    // one partial tile
}

TEST(Fp8Quantize, Blocks128x128RandomWithPartialEdges) {
  const uint64_t seed = printed_seed("Blocks128x128RandomWithPartialEdges");
  SCOPED_TRACE("seed " + std::to_string(seed));
  const int64_t rows = 300, cols = 200, ld = 203;
  const std::vector<float> x = spread_data(rows, ld, seed);
  check_128x128(x.data(), rows, cols, ld);
  check_128x128(x.data(), 128, 128, ld);
  check_128x128(x.data(), 1, 7, ld);
}

// fake_quantize_group (the CPU backend's FP8 operands) equals quantizing then dequantizing, bit
// for bit, for tiles and blocks, including a NaN group.
TEST(Fp8Quantize, FakeQuantizeEqualsDequantizedCodes) {
  const uint64_t seed = printed_seed("FakeQuantizeEqualsDequantizedCodes");
  SCOPED_TRACE("seed " + std::to_string(seed));
  const int64_t rows = 150, cols = 300;
  std::vector<float> x = spread_data(rows, cols, seed);
  x[5 * cols + 140] = NAN;  // row 5's second tile
  std::vector<e4m3> q(x.size());
  std::vector<float> s(static_cast<size_t>(rows * fp8_groups(cols))), want(x.size());
  quantize_1x128(x.data(), rows, cols, cols, q.data(), s.data());
  dequantize_1x128(q.data(), s.data(), rows, cols, want.data());
  std::vector<float> got = x;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; c += kFp8Group)
      fake_quantize_group(got.data(), cols, r, r + 1, c, std::min(cols, c + kFp8Group));
  for (size_t i = 0; i < x.size(); ++i) ASSERT_EQ(bits_of(got[i]), bits_of(want[i])) << i;
  s.assign(static_cast<size_t>(fp8_groups(rows) * fp8_groups(cols)), 0.0f);
  quantize_128x128(x.data(), rows, cols, cols, q.data(), s.data());
  dequantize_128x128(q.data(), s.data(), rows, cols, want.data());
  got = x;
  for (int64_t r = 0; r < rows; r += kFp8Group)
    for (int64_t c = 0; c < cols; c += kFp8Group)
      fake_quantize_group(got.data(), cols, r, std::min(rows, r + kFp8Group), c,
                          std::min(cols, c + kFp8Group));
  for (size_t i = 0; i < x.size(); ++i) ASSERT_EQ(bits_of(got[i]), bits_of(want[i])) << i;
}

TEST(Fp8Quantize, Bf16InputsEqualTheirFloatValues) {
  const uint64_t seed = printed_seed("Bf16InputsEqualTheirFloatValues");
  SCOPED_TRACE("seed " + std::to_string(seed));
  const int64_t rows = 140, cols = 260;
  const std::vector<bf16> xb = test::to_bf16(spread_data(rows, cols, seed));  // (rows, cols)
  const std::vector<float> xf = test::to_float(xb);                           // (rows, cols)
  check_1x128(xb.data(), rows, cols, cols);
  check_128x128(xb.data(), rows, cols, cols);
  std::vector<e4m3> qb(xb.size()), qf(xb.size());  // (rows, cols) each
  std::vector<float> sb(static_cast<size_t>(rows * 3)), sf(sb.size());  // (rows, 3) each
  quantize_1x128(xb.data(), rows, cols, cols, qb.data(), sb.data());
  quantize_1x128(xf.data(), rows, cols, cols, qf.data(), sf.data());
  EXPECT_EQ(std::memcmp(qb.data(), qf.data(), qb.size()), 0);
  EXPECT_EQ(std::memcmp(sb.data(), sf.data(), sb.size() * 4), 0);
}

// A 128x128 block is the same set of elements in W and Wᵀ, so one quantization of the weights
// serves the forward GEMM and, transposed, the data-gradient GEMM.
TEST(Fp8Quantize, TransposedBlocksAreTheTransposedQuantization) {
  const uint64_t seed = printed_seed("TransposedBlocksAreTheTransposedQuantization");
  SCOPED_TRACE("seed " + std::to_string(seed));
  const int64_t rows = 300, cols = 200, rb = 3, cb = 2;
  const std::vector<float> w = spread_data(rows, cols, seed);  // (rows, cols)
  std::vector<float> wt(w.size());                             // (cols, rows)
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) wt[c * rows + r] = w[r * cols + c];
  std::vector<e4m3> q(w.size()), qt(w.size());                 // (rows, cols), (cols, rows)
  std::vector<float> s(rb * cb), st(rb * cb);                  // (rb, cb), (cb, rb)
  quantize_128x128(w.data(), rows, cols, cols, q.data(), s.data());
  quantize_128x128(wt.data(), cols, rows, rows, qt.data(), st.data());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) ASSERT_EQ(q[r * cols + c].bits, qt[c * rows + r].bits);
  for (int64_t i = 0; i < rb; ++i)
    for (int64_t j = 0; j < cb; ++j) ASSERT_EQ(bits_of(s[i * cb + j]), bits_of(st[j * rb + i]));
}

TEST(Fp8Quantize, ZeroTinyHugeAndNonFiniteGroups) {
  const int64_t rows = 4, cols = 384;  // three tiles per row
  std::vector<float> x(static_cast<size_t>(rows * cols), 0.0f);  // (rows, cols)
  // Row 0: all zero (tile 1 with negative zeros). Row 1: tile 0 holds fp32 subnormals, tile 1
  // values near FLT_MAX, tile 2 ordinary values. Row 2: a NaN in tile 1. Row 3: -Inf in tile 2.
  for (int64_t c = 128; c < 256; ++c) x[c] = -0.0f;
  for (int64_t c = 0; c < 128; ++c) x[cols + c] = float_of(static_cast<uint32_t>(1 + 37 * c));
  for (int64_t c = 128; c < 256; ++c) x[cols + c] = FLT_MAX / float(1 + c % 5);
  for (int64_t c = 256; c < 384; ++c) x[cols + c] = 0.25f * float(c % 9) - 1.0f;
  for (int64_t c = 0; c < cols; ++c) x[2 * cols + c] = x[3 * cols + c] = 0.01f * float(c % 13);
  x[2 * cols + 200] = std::numeric_limits<float>::quiet_NaN();
  x[3 * cols + 300] = -std::numeric_limits<float>::infinity();
  check_1x128(x.data(), rows, cols, cols);
  check_128x128(x.data(), rows, cols, cols);

  std::vector<e4m3> q(x.size());   // (rows, cols)
  std::vector<float> s(rows * 3);  // (rows, 3)
  quantize_1x128(x.data(), rows, cols, cols, q.data(), s.data());
  EXPECT_EQ(s[0], 1.0f);
  EXPECT_EQ(s[1], 1.0f);
  EXPECT_EQ(q[128].bits, 0x80);                 // -0 keeps its sign
  EXPECT_EQ(s[3], 0x1p-126f);                   // tiny amax: the scale floor
  EXPECT_TRUE(std::isfinite(s[4]) && s[4] > 0);  // near FLT_MAX: finite
  EXPECT_EQ(bits_of(s[2 * 3 + 1]), kFp8NaNScaleBits);
  EXPECT_EQ(bits_of(s[3 * 3 + 2]), kFp8NaNScaleBits);
  EXPECT_EQ(s[2 * 3 + 0], s[3 * 3 + 0]);        // other tiles of those rows unaffected
  EXPECT_TRUE(std::isfinite(s[2 * 3 + 2]) && std::isfinite(s[3 * 3 + 1]));
  std::vector<float> deq(x.size());  // (rows, cols)
  dequantize_1x128(q.data(), s.data(), rows, cols, deq.data());
  for (int64_t c = 0; c < cols; ++c) {
    EXPECT_EQ(std::isnan(deq[2 * cols + c]), c >= 128 && c < 256) << c;
    EXPECT_EQ(std::isnan(deq[3 * cols + c]), c >= 256) << c;
    EXPECT_TRUE(std::isfinite(deq[cols + c])) << c;
  }
}

// x / scale and x * (1 / scale) rarely give different codes, so random data cannot tell them
// apart: these rows hold values found next to e4m3 midpoints where they do.
TEST(Fp8Quantize, DividesByTheScaleRatherThanMultiplyingByItsInverse) {
  std::vector<float> row;  // one tile: amax first, then the discriminating values
  int64_t tiles = 0, found = 0;
  std::vector<float> x;  // (tiles, 128)
  for (float amax : {1.0f, 3.0f, 5.0f, 7.0f, 0.1f, 1e-3f, 11.0f, 13.0f, 100.0f}) {
    const float scale = fp8_scale(amax), inv = 1.0f / scale;
    row.assign(1, amax);
    const std::vector<double>& t = e4m3_values();
    for (size_t i = 0; i + 1 < t.size() && row.size() < 128; ++i) {
      float v = static_cast<float>(0.5 * (t[i] + t[i + 1]) * scale);
      for (int step = 0; step < 8; ++step) v = std::nextafter(v, 0.0f);
      for (int step = 0; step < 16 && row.size() < 128; ++step, v = std::nextafter(v, 1e30f))
        if (v <= amax && e4m3::from_float(v / scale) != e4m3::from_float(v * inv)) row.push_back(v);
    }
    found += static_cast<int64_t>(row.size()) - 1;
    row.resize(128, 0.0f);
    x.insert(x.end(), row.begin(), row.end());
    ++tiles;
  }
  ASSERT_GT(found, 20) << "no discriminating values found";
  check_1x128(x.data(), tiles, 128, 128);
  check_128x128(x.data(), tiles, 128, 128);
}

TEST(Fp8Quantize, BadDimensionsAreRejected) {
  float x[4] = {};
  e4m3 q[4];
  float s[4];
  EXPECT_THROW(quantize_1x128(x, 2, 2, 1, q, s), InvalidArgument);
  EXPECT_THROW(quantize_128x128(x, -1, 2, 2, q, s), InvalidArgument);
  EXPECT_NO_THROW(quantize_1x128(x, 0, 0, 0, q, s));
}

// ---- the reference FP8 GEMM ----------------------------------------------------------------

struct Quantized {
  std::vector<e4m3> q;     // (rows, cols)
  std::vector<float> s;    // (rows, ceil(cols/128)) or (ceil(rows/128), ceil(cols/128))
};
Quantized quantize_a(const std::vector<float>& a, int64_t M, int64_t K) {
  Quantized r{std::vector<e4m3>(static_cast<size_t>(M * K)),
              std::vector<float>(static_cast<size_t>(M * fp8_groups(K)))};
  quantize_1x128(a.data(), M, K, K, r.q.data(), r.s.data());
  return r;
}
Quantized quantize_b(const std::vector<float>& b, int64_t N, int64_t K) {
  Quantized r{std::vector<e4m3>(static_cast<size_t>(N * K)),
              std::vector<float>(static_cast<size_t>(fp8_groups(N) * fp8_groups(K)))};
  quantize_128x128(b.data(), N, K, K, r.q.data(), r.s.data());
  return r;
}

// The documented order, one (m, n) at a time: must equal gemm_fp8_reference bit for bit.
std::vector<float> gemm_as_documented(int64_t M, int64_t N, int64_t K, const Quantized& a,
                                      const Quantized& b) {
  const int64_t KB = fp8_groups(K);
  std::vector<float> c(static_cast<size_t>(M * N));  // (M, N)
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      float acc = 0.0f;
      for (int64_t kb = 0; kb < KB; ++kb) {
        float s = 0.0f;
        for (int64_t k = kb * 128; k < std::min(K, kb * 128 + 128); ++k)
          s = s + float(a.q[m * K + k]) * float(b.q[n * K + k]);
        acc = std::fma(s, a.s[m * KB + kb] * b.s[(n / 128) * KB + kb], acc);
      }
      c[m * N + n] = acc;
    }
  return c;
}

// float64 GEMM of the exact dequantized operands (q * scale is exact in double), and the sums of
// |products| that bound its fp32 evaluation.
void gemm_dequantized_f64(int64_t M, int64_t N, int64_t K, const Quantized& a, const Quantized& b,
                          std::vector<double>* c, std::vector<double>* abs_sum) {
  const int64_t KB = fp8_groups(K);
  c->assign(static_cast<size_t>(M * N), 0.0);
  abs_sum->assign(static_cast<size_t>(M * N), 0.0);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      double acc = 0, mag = 0;
      for (int64_t k = 0; k < K; ++k) {
        const double av = double(float(a.q[m * K + k])) * a.s[m * KB + k / 128];
        const double bv = double(float(b.q[n * K + k])) * b.s[(n / 128) * KB + k / 128];
        acc += av * bv;
        mag += std::fabs(av * bv);
      }
      (*c)[m * N + n] = acc;
      (*abs_sum)[m * N + n] = mag;
    }
}

std::vector<double> gemm_f64(int64_t M, int64_t N, int64_t K, const std::vector<float>& a,
                             const std::vector<float>& b) {
  std::vector<double> c(static_cast<size_t>(M * N));  // (M, N)
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      double acc = 0;
      for (int64_t k = 0; k < K; ++k) acc += double(a[m * K + k]) * double(b[n * K + k]);
      c[m * N + n] = acc;
    }
  return c;
}

TEST(Fp8Gemm, MatchesDocumentedOrderAndFloat64Bounds) {
  const uint64_t seed = printed_seed("MatchesDocumentedOrderAndFloat64Bounds");
  SCOPED_TRACE("seed " + std::to_string(seed));
  // Partial tiles everywhere: K = 4 blocks + 8, N = 1 block + 72, M not a multiple of anything.
  const int64_t M = 70, N = 200, K = 520;
  const std::vector<float> a = test::random_normal(static_cast<size_t>(M * K), seed);      // (M, K)
  const std::vector<float> b = test::random_normal(static_cast<size_t>(N * K), seed + 1);  // (N, K)
  const Quantized qa = quantize_a(a, M, K), qb = quantize_b(b, N, K);

  std::vector<float> c(static_cast<size_t>(M * N));  // (M, N)
  {
    ThreadCountScope one(1);
    gemm_fp8_reference(M, N, K, qa.q.data(), qa.s.data(), qb.q.data(), qb.s.data(), c.data());
  }
  const std::vector<float> doc = gemm_as_documented(M, N, K, qa, qb);
  ASSERT_EQ(std::memcmp(c.data(), doc.data(), c.size() * 4), 0) << "not the documented order";
  std::vector<float> c2(c.size());  // (M, N) with all threads
  gemm_fp8_reference(M, N, K, qa.q.data(), qa.s.data(), qb.q.data(), qb.s.data(), c2.data());
  ASSERT_EQ(std::memcmp(c.data(), c2.data(), c.size() * 4), 0) << "depends on the thread count";

  // Against the dequantized operands in float64, only the fp32 evaluation differs. A block's
  // sequential sum of L <= 128 exact products errs by <= (L-1) u sum|p| (u = 2^-24); rounding the
  // scale product adds u |s|; each of the KB fmas adds u |acc|. In all, to first order,
  // |c - c64| <= (128 + KB) u sum_k |a_k b_k|; 1.01 covers the second-order terms.
  std::vector<double> c64, abs_sum;
  gemm_dequantized_f64(M, N, K, qa, qb, &c64, &abs_sum);
  const double gamma = (128.0 + double(fp8_groups(K))) * 0x1p-24 * 1.01;
  for (int64_t i = 0; i < M * N; ++i)
    ASSERT_LE(std::fabs(double(c[i]) - c64[i]), gamma * abs_sum[i]) << "element " << i;
  const double rel_deq = test::rel_frobenius(c.data(), c64.data(), c.size());
  EXPECT_LT(rel_deq, 1e-6);

  // Against the unquantized inputs: e4m3 keeps 3 mantissa bits, so a value's relative rounding
  // error is at most 2^-4 and, spread uniformly over half an ulp of a binade [2^e, 2^(e+1)),
  // has rms 2^-4 / sqrt(6). An entry of C sums a_k b_k (d_a,k + d_b,k) over independent
  // zero-mean terms, so ||C_fp8 - C||_F / ||C||_F ~ sqrt(2) * 2^-4 / sqrt(6) = 2^-4 / sqrt(3)
  // ~ 0.036 for Gaussian data (subnormal codes and the fp32 sums add far less). Asserted: 2^-4.
  const std::vector<double> exact = gemm_f64(M, N, K, a, b);
  const double rel = test::rel_frobenius(c.data(), exact.data(), c.size());
  std::printf("[ fp8 ] (%" PRId64 ", %" PRId64 ", %" PRId64 ") rel Frobenius vs float64: "
              "%.4f of the inputs, %.2e of the dequantized inputs\n", M, N, K, rel, rel_deq);
  EXPECT_LT(rel, 0x1p-4);
  EXPECT_GT(rel, 0.01);  // quantization did happen
}

TEST(Fp8Gemm, ZeroRowsBf16InputsAndNaNGroups) {
  const uint64_t seed = printed_seed("ZeroRowsBf16InputsAndNaNGroups");
  SCOPED_TRACE("seed " + std::to_string(seed));
  const int64_t M = 9, N = 130, K = 256;
  std::vector<float> a = test::to_float(test::to_bf16(
      test::random_normal(static_cast<size_t>(M * K), seed)));  // (M, K), bf16 values
  const std::vector<float> b = test::random_normal(static_cast<size_t>(N * K), seed + 1);  // (N, K)
  for (int64_t k = 0; k < K; ++k) a[2 * K + k] = 0.0f;  // row 2: zero (amax 0, scale 1)
  a[5 * K + 130] = std::numeric_limits<float>::quiet_NaN();  // row 5, K block 1: NaN
  const std::vector<bf16> ab = test::to_bf16(a);             // (M, K) the same values as bf16

  Quantized qa = quantize_a(a, M, K);
  Quantized qab{std::vector<e4m3>(qa.q.size()), std::vector<float>(qa.s.size())};
  quantize_1x128(ab.data(), M, K, K, qab.q.data(), qab.s.data());
  ASSERT_EQ(std::memcmp(qa.q.data(), qab.q.data(), qa.q.size()), 0);
  ASSERT_EQ(std::memcmp(qa.s.data(), qab.s.data(), qa.s.size() * 4), 0);
  EXPECT_EQ(qa.s[2 * 2 + 0], 1.0f);
  EXPECT_EQ(qa.s[2 * 2 + 1], 1.0f);

  const Quantized qb = quantize_b(b, N, K);
  std::vector<float> c(static_cast<size_t>(M * N));  // (M, N)
  gemm_fp8_reference(M, N, K, qa.q.data(), qa.s.data(), qb.q.data(), qb.s.data(), c.data());
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      const float v = c[m * N + n];
      if (m == 2) EXPECT_EQ(bits_of(v), 0u) << n;  // +0: sums of +-0 products from 0
      else if (m == 5) EXPECT_TRUE(std::isnan(v)) << n;
      else EXPECT_TRUE(std::isfinite(v)) << m << ", " << n;
    }
}

// ---- measurements for the experiment note (not run in CI) -----------------------------------

// Variant scales for comparison only: power-of-two (2^ceil(log2(amax/448)), UE8M0-style) and a
// single per-tensor amax/448 scale.
void quantize_pow2_1x128(const std::vector<float>& x, int64_t rows, int64_t cols, Quantized* out,
                         bool block128) {
  const int64_t cb = fp8_groups(cols), rb = block128 ? fp8_groups(rows) : rows;
  const int64_t rg = block128 ? 128 : 1;
  out->q.resize(static_cast<size_t>(rows * cols));
  out->s.assign(static_cast<size_t>(rb * cb), 0.0f);
  for (int64_t i = 0; i < rb; ++i)
    for (int64_t j = 0; j < cb; ++j) {
      float amax = 0.0f;
      for (int64_t r = i * rg; r < std::min(rows, (i + 1) * rg); ++r)
        for (int64_t c = j * 128; c < std::min(cols, j * 128 + 128); ++c)
          amax = std::max(amax, std::fabs(x[r * cols + c]));
      int e = 0;
      const float m = std::frexp(amax / 448.0f, &e);  // amax / 448 = m * 2^e, m in [0.5, 1)
      const float scale = amax == 0.0f ? 1.0f : std::ldexp(1.0f, m == 0.5f ? e - 1 : e);
      out->s[i * cb + j] = scale;
      for (int64_t r = i * rg; r < std::min(rows, (i + 1) * rg); ++r)
        for (int64_t c = j * 128; c < std::min(cols, j * 128 + 128); ++c)
          out->q[r * cols + c] = e4m3(x[r * cols + c] / scale);
    }
}

void quantize_per_tensor(const std::vector<float>& x, int64_t rows, int64_t cols, Quantized* out,
                         bool block128) {
  float amax = 0.0f;
  for (float v : x) amax = std::max(amax, std::fabs(v));
  const float scale = fp8_scale(amax);
  const int64_t rb = block128 ? fp8_groups(rows) : rows;
  out->q.resize(x.size());
  out->s.assign(static_cast<size_t>(rb * fp8_groups(cols)), scale);
  for (size_t i = 0; i < x.size(); ++i) out->q[i] = e4m3(x[i] / scale);
}

TEST(Fp8Gemm, DISABLED_ErrorTable) {
  const uint64_t seed = printed_seed("ErrorTable");
  struct Shape { int64_t M, N, K; };
  const Shape shapes[] = {{256, 1024, 4096}, {256, 4096, 1024}, {512, 512, 2048}};
  const char* kinds[] = {"gaussian", "student-t3", "channel-outliers", "rows-2^+-12"};
  std::printf("Relative Frobenius error vs float64, all of C (worst row of C)\n"
              "| (M, N, K) | A data | fp8 1x128/128x128 | pow2 scales | per-tensor | bf16 | "
              "fp8 / bf16 | x*(448/amax) codes differing |\n|---|---|---|---|---|---|---|---|\n");
  for (const Shape& sh : shapes)
    for (int kind = 0; kind < 4; ++kind) {
      const int64_t M = sh.M, N = sh.N, K = sh.K;
      std::mt19937_64 rng(seed + 7 * kind + M + N + K);
      std::vector<float> a(static_cast<size_t>(M * K));  // (M, K)
      std::normal_distribution<float> g(0.0f, 1.0f);
      std::student_t_distribution<float> t3(3.0f);
      for (auto& v : a) v = kind == 1 ? t3(rng) : g(rng);
      if (kind == 2)  // 1% of K channels 100x larger, as in LLM activations
        for (int64_t k = 0; k < K; k += 100)
          for (int64_t m = 0; m < M; ++m) a[m * K + k] *= 100.0f;
      if (kind == 3)  // rows (tokens) whose magnitudes differ by up to 2^24, as gradients can
        for (int64_t m = 0; m < M; ++m) {
          const float mag = std::ldexp(1.0f, static_cast<int>(rng() % 25) - 12);
          for (int64_t k = 0; k < K; ++k) a[m * K + k] *= mag;
        }
      const std::vector<float> b = test::random_normal(static_cast<size_t>(N * K), rng(), 0.02f);
      const std::vector<double> exact = gemm_f64(M, N, K, a, b);
      std::vector<float> c(static_cast<size_t>(M * N));  // (M, N)
      // Relative Frobenius error of c, over all of C and (worst) over single rows of C.
      struct Err { double all, worst_row; };
      auto err_of_c = [&]() {
        Err e{test::rel_frobenius(c.data(), exact.data(), c.size()), 0.0};
        for (int64_t m = 0; m < M; ++m)
          e.worst_row = std::max(e.worst_row, test::rel_frobenius(c.data() + m * N,
                                                                  exact.data() + m * N, N));
        return e;
      };
      auto fp8_err = [&](const Quantized& qa, const Quantized& qb) {
        gemm_fp8_reference(M, N, K, qa.q.data(), qa.s.data(), qb.q.data(), qb.s.data(), c.data());
        return err_of_c();
      };
      const Err e_fp8 = fp8_err(quantize_a(a, M, K), quantize_b(b, N, K));
      Quantized pa, pb, ta, tb;
      quantize_pow2_1x128(a, M, K, &pa, false);
      quantize_pow2_1x128(b, N, K, &pb, true);
      const Err e_pow2 = fp8_err(pa, pb);
      quantize_per_tensor(a, M, K, &ta, false);
      quantize_per_tensor(b, N, K, &tb, true);
      const Err e_tensor = fp8_err(ta, tb);
      // bf16 operands, fp32 accumulation (the bf16 path's GEMM numerics).
      const std::vector<float> ab = test::to_float(test::to_bf16(a));
      const std::vector<float> bb = test::to_float(test::to_bf16(b));
      parallel_for(0, M, 4, [&](int64_t m) {
        for (int64_t n = 0; n < N; ++n) {
          float acc = 0.0f;
          for (int64_t k = 0; k < K; ++k) acc += ab[m * K + k] * bb[n * K + k];
          c[m * N + n] = acc;
        }
      });
      const Err e_bf16 = err_of_c();
      // How often DeepGEMM-style x * (448 / amax) gives another code than x / (amax / 448).
      int64_t differ = 0;
      for (int64_t m = 0; m < M; ++m)
        for (int64_t kb = 0; kb < fp8_groups(K); ++kb) {
          float amax = 0.0f;
          for (int64_t k = kb * 128; k < std::min(K, kb * 128 + 128); ++k)
            amax = std::max(amax, std::fabs(a[m * K + k]));
          const float scale = fp8_scale(amax), inv = 448.0f / amax;
          for (int64_t k = kb * 128; k < std::min(K, kb * 128 + 128); ++k)
            differ += e4m3::from_float(a[m * K + k] / scale) !=
                      e4m3::from_float(a[m * K + k] * inv);
        }
      std::printf("| (%" PRId64 ", %" PRId64 ", %" PRId64 ") | %s | %.4f (%.4f) | %.4f (%.4f) | "
                  "%.4f (%.4f) | %.5f (%.5f) | %.1fx | %" PRId64 " of %" PRId64 " |\n", M, N, K,
                  kinds[kind], e_fp8.all, e_fp8.worst_row, e_pow2.all, e_pow2.worst_row,
                  e_tensor.all, e_tensor.worst_row, e_bf16.all, e_bf16.worst_row,
                  e_fp8.all / e_bf16.all, differ, M * K);
      std::fflush(stdout);
    }
}

}  // namespace
}  // namespace moeblaze
