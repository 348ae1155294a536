// FP8 grouped GEMM with a contiguous A (fp8_grouped_gemm.hpp): the entry point, which runs the
// Fp8Kernel it is given, and two of its instantiations: tma::Fp8GroupedGemm<> (128 x 128 x 128
// tiles, cooperative, single CTAs) and its ping-pong twin on 64 x 128 x 128 tiles (the cluster
// of 2 is fp8_contiguous_c2.cu, compiled beside).
#include <algorithm>
#include <cstdint>

#include "cuda/gemm/fp8_grouped_gemm.hpp"
#include "cuda/gemm/kernels/sm90_tma_grouped_fp8.cuh"
#include "moeblaze/error.hpp"

namespace moeblaze::cuda::gemm::fp8 {

namespace {
using Gemm = tma::Fp8GroupedGemm<>;
using GemmPingPong = tma::Fp8GroupedGemm<cute::Shape<cute::_64, cute::_128, cute::_128>,
                                         cute::Shape<cute::_1, cute::_1, cute::_1>,
                                         tma::Fp8ScaleConfig, tma::Fp8PingPong>;
}  // namespace

void check_fp8_operands(const uint8_t* qa, const float* sa, const uint8_t* qb, const float* sb,
                        const bf16* d, const void* scratch, const Fp8Kernel& kernel) {
  for (const auto& [p, name] : {std::pair<const void*, const char*>{qa, "qa"}, {sa, "sa"},
                                {qb, "qb"}, {sb, "sb"}, {d, "d"}, {scratch, "scratch"}}) {
    MOEBLAZE_REQUIRE(p != nullptr, name, " is null");
    MOEBLAZE_UNSUPPORTED_IF(reinterpret_cast<uintptr_t>(p) % 16 != 0, name,
                            ": the FP8 GEMM needs 16-byte aligned data (TMA)");
  }
  MOEBLAZE_UNSUPPORTED_IF(fp8_variant(kernel) < 0, "kernel (", describe(kernel),
                          "): the FP8 GEMMs are built cooperative on 1 or 2 CTAs and ping-pong "
                          "on 1");
}

size_t contiguous_scratch_bytes(int64_t E) {
  MOEBLAZE_REQUIRE(E >= 1 && E <= INT32_MAX, "E (", E, ") must be in [1, 2^31)");
  const int e = static_cast<int>(E);
  return std::max({Gemm::scratch_bytes(e), GemmPingPong::scratch_bytes(e),
                   detail::contiguous_c2_scratch_bytes(e)});
}

void contiguous(ExpertRows rows, int64_t E, const uint8_t* qa, const float* sa, const uint8_t* qb,
                const float* sb, bf16* d, int64_t N, int64_t K, void* scratch,
                size_t scratch_bytes, cudaStream_t stream, const Fp8Kernel& kernel) {
  MOEBLAZE_REQUIRE(E >= 1 && E <= INT32_MAX, "E (", E, ") must be in [1, 2^31)");
  MOEBLAZE_UNSUPPORTED_IF(N <= 0 || N % 128 != 0 || N > INT32_MAX, "N (", N,
                          ") must be a positive multiple of 128: the weights' 128x128 scale "
                          "blocks tile it");
  MOEBLAZE_UNSUPPORTED_IF(K <= 0 || K % 128 != 0 || K > INT32_MAX, "K (", K,
                          ") must be a positive multiple of 128: every 128 of K has its scale");
  MOEBLAZE_REQUIRE(rows.begin && rows.end && rows.out, "rows: begin / end / out must be given");
  check_fp8_operands(qa, sa, qb, sb, d, scratch, kernel);
  const int e = static_cast<int>(E), n = static_cast<int>(N), k = static_cast<int>(K);
  if (kernel.cluster == 2) {
    detail::contiguous_c2(rows, e, qa, sa, qb, sb, d, n, k, scratch, scratch_bytes, stream);
    return;
  }
  const auto run = kernel.schedule == KernelSchedule::ping_pong ? tma::run_fp8<GemmPingPong>
                                                                : tma::run_fp8<Gemm>;
  run("fp8::contiguous", rows, e, qa, sa, qb, sb, d, n, k, scratch, scratch_bytes, stream);
}

}  // namespace moeblaze::cuda::gemm::fp8
