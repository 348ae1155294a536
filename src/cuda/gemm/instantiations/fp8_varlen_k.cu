// FP8 varlen-K grouped GEMM, the weight gradients (fp8_grouped_gemm.hpp): the entry point, which
// runs the Fp8Kernel it is given, and two instantiations of tma::Fp8GroupedGemm with 1x128 scales
// on both operands: cooperative on 128 x 128 x 128 tiles and ping-pong on 64 x 128 x 128, single
// CTAs (the cluster of 2 is fp8_varlen_k_c2.cu).
#include <algorithm>
#include <cstdint>
#include <utility>

#include "cuda/gemm/fp8_grouped_gemm.hpp"
#include "cuda/gemm/kernels/sm90_tma_grouped_fp8.cuh"
#include "moeblaze/error.hpp"

namespace moeblaze::cuda::gemm::fp8 {

namespace {
using Gemm = tma::Fp8GroupedGemm<cute::Shape<cute::_128, cute::_128, cute::_128>,
                                 cute::Shape<cute::_1, cute::_1, cute::_1>,
                                 tma::Fp8RowScaleConfig>;
using GemmPingPong = tma::Fp8GroupedGemm<cute::Shape<cute::_64, cute::_128, cute::_128>,
                                         cute::Shape<cute::_1, cute::_1, cute::_1>,
                                         tma::Fp8RowScaleConfig, tma::Fp8PingPong>;
}  // namespace

size_t varlen_k_scratch_bytes(int64_t E) {
  MOEBLAZE_REQUIRE(E >= 1 && E <= INT32_MAX, "E (", E, ") must be in [1, 2^31)");
  const int e = static_cast<int>(E);
  return std::max({Gemm::scratch_bytes(e), GemmPingPong::scratch_bytes(e),
                   detail::varlen_k_c2_scratch_bytes(e)});
}

void varlen_k(const int32_t* poff, int64_t E, int64_t M, int64_t N, const uint8_t* qa,
              const float* sa, const uint8_t* qb, const float* sb, bf16* d, void* scratch,
              size_t scratch_bytes, cudaStream_t stream, const Fp8Kernel& kernel) {
  MOEBLAZE_REQUIRE(E >= 1 && E <= INT32_MAX, "E (", E, ") must be in [1, 2^31)");
  MOEBLAZE_UNSUPPORTED_IF(M <= 0 || M % 128 != 0 || M > INT32_MAX, "M (", M,
                          ") must be a positive multiple of 128: whole 128 x 128 output tiles");
  MOEBLAZE_UNSUPPORTED_IF(N <= 0 || N % 128 != 0 || N > INT32_MAX, "N (", N,
                          ") must be a positive multiple of 128: whole 128 x 128 output tiles");
  MOEBLAZE_REQUIRE(poff != nullptr, "poff is null");
  check_fp8_operands(qa, sa, qb, sb, d, scratch, kernel);
  const int e = static_cast<int>(E), m = static_cast<int>(M), n = static_cast<int>(N);
  if (kernel.cluster == 2) {
    detail::varlen_k_c2(poff, e, m, n, qa, sa, qb, sb, d, scratch, scratch_bytes, stream);
    return;
  }
  const auto run = kernel.schedule == KernelSchedule::ping_pong
                       ? tma::run_fp8_varlen_k<GemmPingPong>
                       : tma::run_fp8_varlen_k<Gemm>;
  run("fp8::varlen_k", poff, e, m, n, qa, sa, qb, sb, d, scratch, scratch_bytes, stream);
}

}  // namespace moeblaze::cuda::gemm::fp8
