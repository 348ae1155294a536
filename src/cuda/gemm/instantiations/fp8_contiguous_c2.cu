// FP8 grouped GEMM with a contiguous A (fp8_grouped_gemm.hpp) on clusters of 2 CTAs along N:
// cooperative 128 x 128 x 128 tiles, each pair computing two N tiles of the same rows, A's tiles
// loaded once per pair by TMA multicast. Its own file so that it compiles beside the others.
#include "cuda/gemm/fp8_grouped_gemm.hpp"
#include "cuda/gemm/kernels/sm90_tma_grouped_fp8.cuh"

namespace moeblaze::cuda::gemm::fp8::detail {

namespace {
using Gemm = tma::Fp8GroupedGemm<cute::Shape<cute::_128, cute::_128, cute::_128>,
                                 cute::Shape<cute::_1, cute::_2, cute::_1>>;
}  // namespace

size_t contiguous_c2_scratch_bytes(int E) { return Gemm::scratch_bytes(E); }

void contiguous_c2(ExpertRows rows, int E, const uint8_t* qa, const float* sa, const uint8_t* qb,
                   const float* sb, bf16* d, int N, int K, void* scratch, size_t scratch_bytes,
                   cudaStream_t stream) {
  tma::run_fp8<Gemm>("fp8::contiguous (cluster 2)", rows, E, qa, sa, qb, sb, d, N, K, scratch,
                     scratch_bytes, stream);
}

}  // namespace moeblaze::cuda::gemm::fp8::detail
