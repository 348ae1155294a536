// The FP8 grouped GEMM with a contiguous A (src/cuda/gemm/fp8_grouped_gemm.hpp) against
// a float64 GEMM of the dequantized operands: codes and scales come from the CPU core's
// quantizers (src/core/fp8.hpp, which the GPU quantizers match bit for bit), so the two sides
// multiply the same values and differ only by fp32 summation order and D's bf16 rounding. Fresh
// random inputs (seed printed); experts with no rows, with fewer rows than a tile and with
// partial last tiles; every expert's weights at a different scale so that a misread scale
// layout shows; every built kernel (kFp8Kernels). And the shapes it refuses.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
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

std::vector<uint8_t> bits_of(const std::vector<e4m3>& v) {
  std::vector<uint8_t> b(v.size());
  for (size_t i = 0; i < v.size(); ++i) b[i] = v[i].bits;
  return b;
}

TEST(Fp8GemmGpu, ContiguousMatchesTheDequantizedFloat64Gemm) {
  MOEBLAZE_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const std::vector<int32_t> counts = {130, 0, 1, 300, 77, 128, 256, 5};  // rows per expert
  const int64_t E = int64_t(counts.size()), N = 384, K = 384, KB = K / 128;  // N: 3 tiles, so a cluster of 2 has one past the edge
  std::vector<int32_t> off(E + 1, 0);
  for (int64_t e = 0; e < E; ++e) off[e + 1] = off[e] + counts[e];
  const int64_t S = off[E];

  // A (S, K) in 1x128 tiles; W (E, N, K) in 128x128 blocks, expert e scaled by 4^(e - 3).
  const std::vector<float> a = random_normal(size_t(S * K), seed);
  std::vector<float> w = random_normal(size_t(E * N * K), seed + 1, 0.05f);
  for (int64_t e = 0; e < E; ++e)
    for (int64_t i = 0; i < N * K; ++i) w[e * N * K + i] *= std::ldexp(1.0f, int(2 * (e - 3)));
  std::vector<e4m3> qa(size_t(S * K)), qb(size_t(E * N * K));
  std::vector<float> sa(size_t(S * KB)), sb(size_t(E * (N / 128) * KB));
  quantize_1x128(a.data(), S, K, K, qa.data(), sa.data());
  for (int64_t e = 0; e < E; ++e)
    quantize_128x128(w.data() + e * N * K, N, K, K, qb.data() + e * N * K,
                     sb.data() + e * (N / 128) * KB);
  std::vector<float> da(size_t(S * K)), dw(size_t(E * N * K));
  dequantize_1x128(qa.data(), sa.data(), S, K, da.data());
  for (int64_t e = 0; e < E; ++e)
    dequantize_128x128(qb.data() + e * N * K, sb.data() + e * (N / 128) * KB, N, K,
                       dw.data() + e * N * K);
  std::vector<double> ref(size_t(S * N), 0.0);
  for (int64_t e = 0; e < E; ++e)
    for (int64_t r = off[e]; r < off[e + 1]; ++r)
      for (int64_t n = 0; n < N; ++n) {
        double acc = 0;
        for (int64_t k = 0; k < K; ++k)
          acc += double(da[r * K + k]) * double(dw[(e * N + n) * K + k]);
        ref[r * N + n] = acc;
      }

  DevMem d_off(off), d_qa(bits_of(qa)), d_sa(sa), d_qb(bits_of(qb)), d_sb(sb);
  DevMem d_d(size_t(S * N) * 2);
  const size_t scratch_bytes = g8::contiguous_scratch_bytes(E);
  DevMem scratch(scratch_bytes);
  const cuda::gemm::ExpertRows rows{d_off.as<int32_t>(), d_off.as<int32_t>() + 1,
                                    d_off.as<int32_t>()};
  for (const cuda::gemm::Fp8Kernel& sched : cuda::gemm::kFp8Kernels) {
    SCOPED_TRACE(cuda::gemm::describe(sched));
    MOEBLAZE_TEST_CUDA(cudaMemset(d_d.p, 0xFF, d_d.bytes));  // NaN: a row left unwritten fails
    g8::contiguous(rows, E, d_qa.as<uint8_t>(), d_sa.as<float>(), d_qb.as<uint8_t>(),
                   d_sb.as<float>(), d_d.as<bf16>(), N, K, scratch.p, scratch_bytes, nullptr,
                   sched);
    const std::vector<bf16> got = d_d.download<bf16>();
    for (int64_t e = 0; e < E; ++e) {
      if (counts[e] == 0) continue;
      SCOPED_TRACE("expert " + std::to_string(e) + " (" + std::to_string(counts[e]) + " rows)");
      const size_t at = size_t(off[e] * N), n = size_t(counts[e] * N);
      EXPECT_LE(rel_frobenius(got.data() + at, ref.data() + at, n), rel_tolerance(DType::bf16));
    }
  }
}

TEST(Fp8GemmGpu, ContiguousRefusesWhatItCannotTake) {
  MOEBLAZE_REQUIRE_GPU();
  DevMem off(std::vector<int32_t>{0, 0}), buf(1 << 16);
  const cuda::gemm::ExpertRows rows{off.as<int32_t>(), off.as<int32_t>() + 1, off.as<int32_t>()};
  const auto call = [&](int64_t N, int64_t K, const uint8_t* qa) {
    g8::contiguous(rows, 1, qa, buf.as<float>(), buf.as<uint8_t>(), buf.as<float>(),
                   buf.as<bf16>(), N, K, buf.p, buf.bytes, nullptr);
  };
  EXPECT_THROW(call(200, 128, buf.as<uint8_t>()), Unsupported);   // N not a multiple of 128
  EXPECT_THROW(call(128, 64, buf.as<uint8_t>()), Unsupported);    // K not a multiple of 128
  EXPECT_THROW(call(128, 128, buf.as<uint8_t>() + 8), Unsupported);  // qa not 16-byte aligned
  EXPECT_THROW(call(128, 128, nullptr), InvalidArgument);
  EXPECT_THROW(g8::contiguous_scratch_bytes(0), InvalidArgument);
}

}  // namespace
}  // namespace moeblaze::test
