// The FP8 varlen-K grouped GEMM (fp8::varlen_k, src/cuda/gemm/fp8_grouped_gemm.hpp: the weight
// gradients) against a float64 sum of the dequantized products: random finite e4m3 codes and
// random positive 1x128 scales on both operands, experts of 1 to 5 K blocks, so that a misread
// per-expert offset, scale layout or K extent shows; the two sides differ only by fp32 summation
// order and D's bf16 rounding; every built kernel (kFp8Kernels). And the shapes and scratch it
// refuses.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "common/test_util.hpp"
#include "core/fp8.hpp"
#include "cuda/gemm/fp8_grouped_gemm.hpp"
#include "gpu/gpu_test_util.hpp"
#include "moeblaze/error.hpp"

namespace moeblaze::test {
namespace {

namespace g8 = moeblaze::cuda::gemm::fp8;

// count random e4m3 codes, every finite one possible (0x7F / 0xFF, the NaNs, redrawn).
std::vector<uint8_t> random_codes(size_t count, std::mt19937_64& rng) {
  std::uniform_int_distribution<int> byte(0, 255);
  std::vector<uint8_t> q(count);
  for (auto& c : q) {
    int b;
    do b = byte(rng);
    while ((b & 0x7F) == 0x7F);
    c = static_cast<uint8_t>(b);
  }
  return q;
}

// count random positive scales in [2^-6, 2^6).
std::vector<float> random_scales(size_t count, std::mt19937_64& rng) {
  std::uniform_real_distribution<float> log2s(-6.0f, 6.0f);
  std::vector<float> s(count);
  for (auto& v : s) v = std::exp2(log2s(rng));
  return s;
}

TEST(Fp8VarlenKGpu, MatchesTheDequantizedFloat64Gemm) {
  MOEBLAZE_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const std::vector<int32_t> p = {128, 256, 128, 384, 640};  // tokens per expert (K extents)
  const int64_t E = int64_t(p.size()), M = 256, N = 384;
  std::vector<int32_t> poff(E + 1, 0);  // (E + 1,) token offsets
  for (int64_t e = 0; e < E; ++e) poff[e + 1] = poff[e] + p[e];
  const int64_t P = poff[E];

  // Expert e's blocks start at M·poff[e] (codes) and M·poff[e]/128 (scales), likewise with N.
  const std::vector<uint8_t> qa = random_codes(size_t(M * P), rng);  // (M·P) codes
  const std::vector<float> sa = random_scales(size_t(M * P / 128), rng);  // (M·P/128)
  const std::vector<uint8_t> qb = random_codes(size_t(N * P), rng);  // (N·P) codes
  const std::vector<float> sb = random_scales(size_t(N * P / 128), rng);  // (N·P/128)

  std::vector<double> ref(size_t(E * M * N), 0.0);  // (E, M, N)
  for (int64_t e = 0; e < E; ++e) {
    const int64_t pe = p[e], kb = pe / 128;
    // Expert e's dequantized operands: (M, P_e) and (N, P_e), exact in double.
    std::vector<double> da(size_t(M * pe)), db(size_t(N * pe));
    for (int64_t m = 0; m < M; ++m)
      for (int64_t k = 0; k < pe; ++k)
        da[m * pe + k] = double(e4m3::to_float(qa[M * poff[e] + m * pe + k])) *
                         double(sa[M * poff[e] / 128 + m * kb + k / 128]);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t k = 0; k < pe; ++k)
        db[n * pe + k] = double(e4m3::to_float(qb[N * poff[e] + n * pe + k])) *
                         double(sb[N * poff[e] / 128 + n * kb + k / 128]);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n) {
        double acc = 0;
        for (int64_t k = 0; k < pe; ++k) acc += da[m * pe + k] * db[n * pe + k];
        ref[(e * M + m) * N + n] = acc;
      }
  }

  DevMem d_poff(poff), d_qa(qa), d_sa(sa), d_qb(qb), d_sb(sb);
  DevMem d_d(size_t(E * M * N) * 2);  // (E, M, N) bf16
  const size_t scratch_bytes = g8::varlen_k_scratch_bytes(E);
  DevMem scratch(scratch_bytes);
  for (const cuda::gemm::Fp8Kernel& sched : cuda::gemm::kFp8Kernels) {
    SCOPED_TRACE(cuda::gemm::describe(sched));
    d_d.poison();  // NaN: a tile left unwritten fails
    g8::varlen_k(d_poff.as<int32_t>(), E, M, N, d_qa.as<uint8_t>(), d_sa.as<float>(),
                 d_qb.as<uint8_t>(), d_sb.as<float>(), d_d.as<bf16>(), scratch.p, scratch_bytes,
                 nullptr, sched);
    MOEBLAZE_TEST_CUDA(cudaGetLastError());
    const std::vector<bf16> got = d_d.download<bf16>();
    for (int64_t e = 0; e < E; ++e) {
      SCOPED_TRACE("expert " + std::to_string(e) + " (K = " + std::to_string(p[e]) + ")");
      const size_t at = size_t(e * M * N), n = size_t(M * N);
      EXPECT_LE(rel_frobenius(got.data() + at, ref.data() + at, n), rel_tolerance(DType::bf16));
    }
  }
}

TEST(Fp8VarlenKGpu, RefusesWhatItCannotTake) {
  MOEBLAZE_REQUIRE_GPU();
  const size_t scratch_bytes = g8::varlen_k_scratch_bytes(1);
  DevMem poff(std::vector<int32_t>{0, 0}), buf(1 << 16), scratch(scratch_bytes);
  const auto call = [&](int64_t M, int64_t N, size_t bytes, const uint8_t* qa) {
    g8::varlen_k(poff.as<int32_t>(), 1, M, N, qa, buf.as<float>(), buf.as<uint8_t>(),
                 buf.as<float>(), buf.as<bf16>(), scratch.p, bytes, nullptr);
  };
  EXPECT_THROW(call(200, 128, scratch_bytes, buf.as<uint8_t>()), Unsupported);  // M % 128
  EXPECT_THROW(call(128, 200, scratch_bytes, buf.as<uint8_t>()), Unsupported);  // N % 128
  EXPECT_THROW(call(0, 128, scratch_bytes, buf.as<uint8_t>()), Unsupported);    // M = 0
  EXPECT_THROW(call(128, 128, scratch_bytes / 2, buf.as<uint8_t>()), InvalidArgument);  // scratch
  EXPECT_THROW(call(128, 128, scratch_bytes, buf.as<uint8_t>() + 8), Unsupported);  // unaligned
  EXPECT_THROW(call(128, 128, scratch_bytes, nullptr), InvalidArgument);
  EXPECT_THROW(g8::varlen_k_scratch_bytes(0), InvalidArgument);
  MOEBLAZE_TEST_CUDA(cudaDeviceSynchronize());  // nothing was enqueued that could fail
}

}  // namespace
}  // namespace moeblaze::test
