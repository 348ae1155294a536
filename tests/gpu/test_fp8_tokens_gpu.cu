// The token-axis FP8 quantizer of the weight-gradient GEMM operands
// (src/cuda/fp8/quantize_tokens.hpp) against the CPU core (src/core/fp8.hpp): the padded
// offsets, every code byte (padding included) and every scale compared bit for bit on fresh
// random inputs (seed printed). The expected output is built per expert from quantize_1x128 of the
// expert's (C, K_e) transposed segment — a group is a column's up-to-128 slots — placed into the
// padded K-major layout: padding codes 0x00, padding-only groups (and an empty expert's single
// group) scale 1 with codes 0.
// Inputs cover experts with 0, 1, 128, 129 and 300 slots (plus random ones), slot-ordered and
// gathered sources (a random gather with repeats from a larger T x C source), ld == C and ld > C
// (vector and scalar loads), exact +-0, an all-zero column, a large-magnitude column, a column
// below the amax floor, and a NaN and an Inf in partial groups (NaN scale: real codes 0x7F,
// padding still 0x00). Unread source elements (columns [C, ld), rows no slot maps to) hold NaN,
// so a kernel reading them fails; outputs are poisoned (0xFF) and must stay so past poff[E].
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "common/test_util.hpp"
#include "core/fp8.hpp"
#include "cuda/fp8/quantize_tokens.hpp"
#include "gpu/gpu_test_util.hpp"
#include "moeblaze/error.hpp"

namespace moeblaze::test {
namespace {

namespace f8 = moeblaze::cuda::fp8;

constexpr size_t kGuard = 64;  // bytes after each output that must stay 0xFF

bf16 bf16_bits(uint16_t b) {
  bf16 v;
  v.bits = b;
  return v;
}
const bf16 kNaN16 = bf16_bits(0x7fc1u);

std::vector<int32_t> offsets_of(const std::vector<int32_t>& sizes) {  // (E+1,)
  std::vector<int32_t> off(sizes.size() + 1, 0);
  for (size_t e = 0; e < sizes.size(); ++e) off[e + 1] = off[e] + sizes[e];
  return off;
}

// poff (E+1,) by the rule: P_e = max(128, roundup(K_e, 128)).
std::vector<int32_t> padded_offsets(const std::vector<int32_t>& off) {
  std::vector<int32_t> poff(off.size(), 0);
  for (size_t e = 0; e + 1 < off.size(); ++e) {
    const int32_t k = off[e + 1] - off[e];
    poff[e + 1] = poff[e] + std::max<int32_t>(128, (k + 127) / 128 * 128);
  }
  return poff;
}

struct Expected {
  std::vector<int32_t> poff;  // (E+1,)
  std::vector<uint8_t> q;     // (C * poff[E],) per expert a (C, P_e) K-major code block
  std::vector<float> sc;      // (C * poff[E] / 128,) per expert a (C, P_e / 128) scale block
};

// The core's quantize_1x128 of each expert's transposed (C, K_e) segment, placed in the padded
// layout; everything else (padding codes, padding-only groups) 0 codes and scale 1.
Expected expected_tokens(const std::vector<bf16>& src, int64_t ld,
                         const std::vector<int32_t>* rows_of, const std::vector<int32_t>& off,
                         int64_t C) {
  const int64_t E = int64_t(off.size()) - 1;
  Expected x;
  x.poff = padded_offsets(off);
  const int64_t total = x.poff[E];
  x.q.assign(size_t(C * total), 0);
  x.sc.assign(size_t(C * total / 128), 1.0f);
  for (int64_t e = 0; e < E; ++e) {
    const int64_t K = off[e + 1] - off[e], P = x.poff[e + 1] - x.poff[e], kb = fp8_groups(K);
    if (K == 0) continue;
    std::vector<bf16> seg(size_t(C * K));  // (C, K): expert e's slots, column-major
    for (int64_t i = 0; i < K; ++i) {
      const int64_t s = off[e] + i, row = rows_of ? (*rows_of)[size_t(s)] : s;
      for (int64_t c = 0; c < C; ++c) seg[size_t(c * K + i)] = src[size_t(row * ld + c)];
    }
    std::vector<e4m3> qe(size_t(C * K));   // (C, K)
    std::vector<float> se(size_t(C * kb));  // (C, kb)
    quantize_1x128(seg.data(), C, K, K, qe.data(), se.data());
    for (int64_t c = 0; c < C; ++c) {
      for (int64_t i = 0; i < K; ++i)
        x.q[size_t(C * x.poff[e] + c * P + i)] = qe[size_t(c * K + i)].bits;
      for (int64_t g = 0; g < kb; ++g)
        x.sc[size_t(C * x.poff[e] / 128 + c * (P / 128) + g)] = se[size_t(c * kb + g)];
    }
  }
  return x;
}

// (expert, column, padded slot) of element i of the padded layout (a code index, or a scale
// index times 128), for messages.
std::string where(const std::vector<int32_t>& poff, int64_t C, int64_t i) {
  int64_t e = 0;
  while (C * poff[size_t(e + 1)] <= i) ++e;
  const int64_t P = poff[size_t(e + 1)] - poff[size_t(e)], rel = i - C * poff[size_t(e)];
  return "expert " + std::to_string(e) + " column " + std::to_string(rel / P) + " slot " +
         std::to_string(rel % P);
}

struct Source {
  std::vector<bf16> x;         // (rows, ld)
  std::vector<int32_t> rows_of;  // (S,) or empty
};

// Random source for `off`: slot s reads row rows_of[s] (gather) or s. Unread elements are NaN.
Source make_source(const std::vector<int32_t>& off, int64_t C, int64_t ld, bool gather,
                   std::mt19937_64& rng) {
  const int64_t S = off.back(), T = gather ? S + 41 : S, rows = T + 2;  // 2 rows past T: NaN
  Source src;
  src.x.assign(size_t(rows * ld), kNaN16);
  std::vector<char> used(size_t(rows), 0);
  if (gather) {
    src.rows_of.resize(size_t(S));
    for (auto& r : src.rows_of) r = int32_t(rng() % uint64_t(T));  // repeats allowed
    for (int32_t r : src.rows_of) used[size_t(r)] = 1;
  } else {
    std::fill(used.begin(), used.begin() + S, 1);
  }
  std::vector<float> col_mag(static_cast<size_t>(C));
  for (auto& m : col_mag) m = std::ldexp(1.0f, int(rng() % 21) - 10);
  col_mag[3] = 0x1p100f;  // a large-magnitude column (C >= 128)
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (int64_t r = 0; r < rows; ++r) {
    if (!used[size_t(r)]) continue;
    for (int64_t c = 0; c < C; ++c) {
      float v = nd(rng) * col_mag[size_t(c)];
      if (rng() % 20 == 0) v = rng() & 1 ? -0.0f : 0.0f;  // exact zeros, either sign
      if (c == 7) v = rng() & 1 ? -0.0f : 0.0f;  // an all-zero column: scale 1
      if (c == 11)  // below the amax floor: the floored scale
        v = float_of(uint32_t(rng() % bits_of(kFp8MinAmax)) | (rng() & 1 ? 0x80000000u : 0u));
      src.x[size_t(r * ld + c)] = bf16(v);
    }
  }
  return src;
}

// Slot s's element of column c in the source (the one the kernel reads).
bf16& at(Source& src, int64_t ld, int64_t s, int64_t c) {
  const int64_t row = src.rows_of.empty() ? s : src.rows_of[size_t(s)];
  return src.x[size_t(row * ld + c)];
}

// One case: the padded offsets and the quantization on the GPU against expected_tokens.
void check_case(const char* name, std::vector<int32_t> sizes, int64_t C, int64_t ld, bool gather,
                uint64_t seed) {
  std::mt19937_64 rng(seed);
  for (int k = 0; k < 3; ++k) sizes.push_back(int32_t(rng() % 261));  // fresh sizes each run
  std::ostringstream trace;
  trace << name << ": C " << C << " ld " << ld << (gather ? " gathered" : " by slot")
        << " sizes";
  for (int32_t k : sizes) trace << ' ' << k;
  SCOPED_TRACE(trace.str());
  const std::vector<int32_t> off = offsets_of(sizes);
  const int64_t E = int64_t(sizes.size()), S = off.back();
  Source src = make_source(off, C, ld, gather, rng);
  // A NaN and an Inf in partial groups (with padding after them): the first expert with a
  // partial last group takes the NaN in column 1 (its last slot), the last such expert the -Inf
  // in column 2 (mid-way through its last group).
  for (int64_t e = 0; e < E; ++e)
    if (sizes[size_t(e)] % 128 != 0) {
      at(src, ld, off[size_t(e + 1)] - 1, 1) = kNaN16;
      break;
    }
  for (int64_t e = E - 1; e >= 0; --e)
    if (sizes[size_t(e)] % 128 != 0) {
      const int32_t k = sizes[size_t(e)];
      at(src, ld, off[size_t(e)] + k - 1 - (k % 128) / 2, 2) = bf16_bits(0xff80u);  // -Inf
      break;
    }
  const Expected want =
      expected_tokens(src.x, ld, gather ? &src.rows_of : nullptr, off, C);
  const int64_t total = want.poff.back(), bound = f8::padded_tokens_bound(S, E);
  ASSERT_LE(total, bound);

  DevMem d_src(src.x), d_off(off), d_rows(src.rows_of);
  DevMem d_poff(size_t(E + 1) * 4 + kGuard);        // (E+1,) int32
  DevMem d_q(size_t(C * bound) + kGuard);           // (C * bound,) codes
  DevMem d_sc(size_t(C * (bound / 128)) * 4 + kGuard);  // (C * bound / 128,) scales
  d_poff.poison();
  d_q.poison();
  d_sc.poison();
  f8::padded_token_offsets_async(d_off.as<int32_t>(), E, d_poff.as<int32_t>(), nullptr);
  f8::quantize_tokens_128x1_async(d_src.as<bf16>(), ld, gather ? d_rows.as<int32_t>() : nullptr,
                                  d_off.as<int32_t>(), d_poff.as<int32_t>(), E, S, C,
                                  d_q.as<uint8_t>(), d_sc.as<float>(), nullptr);
  MOEBLAZE_TEST_CUDA(cudaGetLastError());
  const std::vector<uint8_t> got_poff = d_poff.download<uint8_t>();
  const std::vector<uint8_t> got_q = d_q.download<uint8_t>(), got_s = d_sc.download<uint8_t>();

  ASSERT_EQ(std::memcmp(got_poff.data(), want.poff.data(), want.poff.size() * 4), 0)
      << "padded offsets differ";
  for (size_t i = want.poff.size() * 4; i < got_poff.size(); ++i)
    ASSERT_EQ(got_poff[i], 0xFF) << "poff written past E + 1";

  int64_t bad = 0;
  std::ostringstream first;
  for (size_t i = 0; i < want.sc.size(); ++i) {
    float g;
    std::memcpy(&g, got_s.data() + 4 * i, 4);
    if (bits_of(g) != bits_of(want.sc[i])) {
      if (bad < 8)
        first << "\n  scale of " << where(want.poff, C, int64_t(i) * 128) << ": gpu 0x"
              << std::hex << bits_of(g) << " cpu 0x" << bits_of(want.sc[i]) << std::dec;
      ++bad;
    }
  }
  EXPECT_EQ(bad, 0) << bad << " of " << want.sc.size() << " scales differ" << first.str();
  for (size_t i = want.sc.size() * 4; i < got_s.size(); ++i)
    ASSERT_EQ(got_s[i], 0xFF) << "scale written past C * poff[E] / 128 (byte " << i << ")";

  bad = 0;
  first.str("");
  for (size_t i = 0; i < want.q.size(); ++i)
    if (got_q[i] != want.q[i]) {
      if (bad < 8)
        first << "\n  code of " << where(want.poff, C, int64_t(i)) << ": gpu 0x" << std::hex
              << int(got_q[i]) << " cpu 0x" << int(want.q[i]) << std::dec;
      ++bad;
    }
  EXPECT_EQ(bad, 0) << bad << " of " << want.q.size() << " codes differ" << first.str();
  for (size_t i = want.q.size(); i < got_q.size(); ++i)
    ASSERT_EQ(got_q[i], 0xFF) << "code written past C * poff[E] (byte " << i << ")";

  // The rules stated directly (independently of expected_tokens): an empty expert is one group of
  // scale 1 and codes 0; every padding code is 0x00; the NaN / Inf groups have NaN scales.
  int64_t nan_scales = 0;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t K = sizes[size_t(e)], p0 = want.poff[size_t(e)];
    const int64_t P = want.poff[size_t(e + 1)] - p0;
    for (int64_t c = 0; c < C; ++c) {
      for (int64_t i = K; i < P; ++i)
        ASSERT_EQ(got_q[size_t(C * p0 + c * P + i)], 0) << "padding code, expert " << e;
      for (int64_t g = 0; g < P / 128; ++g) {
        float v;
        std::memcpy(&v, got_s.data() + 4 * (C * p0 / 128 + c * (P / 128) + g), 4);
        if (K == 0) ASSERT_EQ(bits_of(v), bits_of(1.0f)) << "empty expert " << e << " scale";
        nan_scales += bits_of(v) == kFp8NaNScaleBits;
      }
    }
    if (K == 0) EXPECT_EQ(P, 128) << "empty expert " << e;
  }
  EXPECT_GE(nan_scales, 2) << "the NaN and Inf groups";
}

// ---- the tests ------------------------------------------------------------------------------

TEST(Fp8TokensGpu, BySlotMatchesCore) {
  MOEBLAZE_REQUIRE_GPU();
  const uint64_t seed = printed_seed("Fp8TokensGpu.BySlotMatchesCore");
  SCOPED_TRACE("seed " + std::to_string(seed));
  check_case("by slot", {0, 1, 128, 129, 300, 57, 0, 200}, 256, 256, false, seed);
  check_case("by slot, ld > C", {300, 0, 129, 1, 128}, 256, 264, false, seed + 1);
}

TEST(Fp8TokensGpu, GatheredMatchesCore) {
  MOEBLAZE_REQUIRE_GPU();
  const uint64_t seed = printed_seed("Fp8TokensGpu.GatheredMatchesCore");
  SCOPED_TRACE("seed " + std::to_string(seed));
  check_case("by slot, three column blocks", {129, 0, 300, 1, 128, 0, 77}, 384, 384, false,
             seed);
  check_case("gathered", {129, 0, 300, 1, 128, 0, 77}, 384, 384, true, seed + 1);
  // ld * 2 not a multiple of 16: the scalar loads.
  check_case("gathered, ld > C, scalar loads", {300, 128, 1, 0, 129}, 128, 131, true, seed + 2);
}

// S == 0: no source at all, every expert one zero group.
TEST(Fp8TokensGpu, AllExpertsEmpty) {
  MOEBLAZE_REQUIRE_GPU();
  const int64_t E = 3, C = 256, bound = f8::padded_tokens_bound(0, E);
  const std::vector<int32_t> off(size_t(E + 1), 0);
  DevMem d_off(off), d_poff(size_t(E + 1) * 4), d_q(size_t(C * bound) + kGuard),
      d_sc(size_t(C * bound / 128) * 4 + kGuard);
  d_q.poison();
  d_sc.poison();
  f8::padded_token_offsets_async(d_off.as<int32_t>(), E, d_poff.as<int32_t>(), nullptr);
  f8::quantize_tokens_128x1_async(nullptr, C, nullptr, d_off.as<int32_t>(), d_poff.as<int32_t>(),
                                  E, 0, C, d_q.as<uint8_t>(), d_sc.as<float>(), nullptr);
  const std::vector<int32_t> poff = d_poff.download<int32_t>();
  EXPECT_EQ(poff, (std::vector<int32_t>{0, 128, 256, 384}));
  const std::vector<uint8_t> q = d_q.download<uint8_t>();
  const std::vector<float> sc = d_sc.download<float>();
  for (int64_t i = 0; i < C * bound; ++i) ASSERT_EQ(q[size_t(i)], 0) << "code " << i;
  for (int64_t i = 0; i < C * bound / 128; ++i) ASSERT_EQ(sc[size_t(i)], 1.0f) << "scale " << i;
  for (size_t i = size_t(C * bound); i < q.size(); ++i) ASSERT_EQ(q[i], 0xFF) << "guard";
}

// The one-CTA scan with several experts per thread (E > 1024) and with one expert.
TEST(Fp8TokensGpu, PaddedOffsetsManyExperts) {
  MOEBLAZE_REQUIRE_GPU();
  const uint64_t seed = printed_seed("Fp8TokensGpu.PaddedOffsetsManyExperts");
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (int64_t E : {int64_t(1), int64_t(31), int64_t(1024), int64_t(3001)}) {
    std::vector<int32_t> sizes(static_cast<size_t>(E));
    for (auto& k : sizes) k = rng() % 5 == 0 ? 0 : int32_t(rng() % 400);
    const std::vector<int32_t> off = offsets_of(sizes), want = padded_offsets(off);
    DevMem d_off(off), d_poff(size_t(E + 1) * 4 + kGuard);
    d_poff.poison();
    f8::padded_token_offsets_async(d_off.as<int32_t>(), E, d_poff.as<int32_t>(), nullptr);
    const std::vector<uint8_t> got = d_poff.download<uint8_t>();
    EXPECT_EQ(std::memcmp(got.data(), want.data(), want.size() * 4), 0) << "E " << E;
    for (size_t i = want.size() * 4; i < got.size(); ++i) ASSERT_EQ(got[i], 0xFF) << "E " << E;
    EXPECT_LE(want.back(), f8::padded_tokens_bound(off.back(), E));
  }
}

// Argument checks run on the host before any CUDA call: no GPU needed.
TEST(Fp8TokensGpuChecks, BadArgumentsThrowBeforeLaunch) {
  const bf16* x = reinterpret_cast<const bf16*>(uintptr_t(256));  // never dereferenced
  const int32_t* off = reinterpret_cast<const int32_t*>(uintptr_t(512));
  const int32_t* poff = reinterpret_cast<const int32_t*>(uintptr_t(768));
  uint8_t* q = reinterpret_cast<uint8_t*>(uintptr_t(1024));
  float* s = reinterpret_cast<float*>(uintptr_t(2048));
  for (int64_t C : {int64_t(200), int64_t(64), int64_t(129)}) {
    EXPECT_THROW(f8::quantize_tokens_128x1_async(x, 256, nullptr, off, poff, 4, 1000, C, q, s,
                                                 nullptr),
                 Unsupported)
        << "C " << C;
  }
  try {
    f8::quantize_tokens_128x1_async(x, 256, nullptr, off, poff, 4, 1000, 200, q, s, nullptr);
    ADD_FAILURE() << "C 200 accepted";
  } catch (const Unsupported& e) {
    EXPECT_NE(std::string(e.what()).find("C (200)"), std::string::npos) << e.what();
  }
  EXPECT_THROW(f8::quantize_tokens_128x1_async(x, 256, nullptr, off, poff, 0, 1000, 256, q, s,
                                               nullptr),
               InvalidArgument);  // E == 0
  EXPECT_THROW(f8::quantize_tokens_128x1_async(x, 255, nullptr, off, poff, 4, 1000, 256, q, s,
                                               nullptr),
               InvalidArgument);  // ld < C
  EXPECT_THROW(f8::quantize_tokens_128x1_async(x, 256, nullptr, off, poff, 4, 1000, 256, q + 1,
                                               s, nullptr),
               InvalidArgument);  // q not 16-byte aligned
  EXPECT_THROW(f8::quantize_tokens_128x1_async(x, 256, nullptr, off, nullptr, 4, 1000, 256, q, s,
                                               nullptr),
               InvalidArgument);
  EXPECT_THROW(f8::quantize_tokens_128x1_async(x, 256, nullptr, off, poff, 4, INT32_MAX, 256, q,
                                               s, nullptr),
               InvalidArgument);  // S + 128 E past int32
  EXPECT_THROW(f8::padded_token_offsets_async(off, 0, const_cast<int32_t*>(poff), nullptr),
               InvalidArgument);
  EXPECT_EQ(f8::padded_tokens_bound(1000, 4), 1000 + 512);
}

}  // namespace
}  // namespace moeblaze::test
