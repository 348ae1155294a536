// FP8 grouped GEMM with a contiguous A (fp8_grouped_gemm.hpp): one instantiation,
// tma::Fp8GroupedGemm<> (128 x 128 x 128 tiles, no cluster).
#include <cstdint>

#include "cuda/gemm/fp8_grouped_gemm.hpp"
#include "cuda/gemm/kernels/sm90_tma_grouped_fp8.cuh"
#include "moeblaze/error.hpp"

namespace moeblaze::cuda::gemm::fp8 {

namespace {
using Gemm = tma::Fp8GroupedGemm<>;
}  // namespace

size_t contiguous_scratch_bytes(int64_t E) {
  MOEBLAZE_REQUIRE(E >= 1 && E <= INT32_MAX, "E (", E, ") must be in [1, 2^31)");
  return Gemm::scratch_bytes(static_cast<int>(E));
}

void contiguous(ExpertRows rows, int64_t E, const uint8_t* qa, const float* sa, const uint8_t* qb,
                const float* sb, bf16* d, int64_t N, int64_t K, void* scratch,
                size_t scratch_bytes, cudaStream_t stream) {
  MOEBLAZE_REQUIRE(E >= 1 && E <= INT32_MAX, "E (", E, ") must be in [1, 2^31)");
  MOEBLAZE_UNSUPPORTED_IF(N <= 0 || N % 128 != 0 || N > INT32_MAX, "N (", N,
                          ") must be a positive multiple of 128: the weights' 128x128 scale "
                          "blocks tile it");
  MOEBLAZE_UNSUPPORTED_IF(K <= 0 || K % 128 != 0 || K > INT32_MAX, "K (", K,
                          ") must be a positive multiple of 128: every 128 of K has its scale");
  MOEBLAZE_REQUIRE(rows.begin && rows.end && rows.out, "rows: begin / end / out must be given");
  for (const auto& [p, name] : {std::pair<const void*, const char*>{qa, "qa"}, {sa, "sa"},
                                {qb, "qb"}, {sb, "sb"}, {d, "d"}, {scratch, "scratch"}}) {
    MOEBLAZE_REQUIRE(p != nullptr, name, " is null");
    MOEBLAZE_UNSUPPORTED_IF(reinterpret_cast<uintptr_t>(p) % 16 != 0, name,
                            ": the FP8 GEMM needs 16-byte aligned data (TMA)");
  }
  tma::run_fp8<Gemm>("fp8::contiguous", rows, static_cast<int>(E), qa, sa, qb, sb, d,
                     static_cast<int>(N), static_cast<int>(K), scratch, scratch_bytes, stream);
}

}  // namespace moeblaze::cuda::gemm::fp8
