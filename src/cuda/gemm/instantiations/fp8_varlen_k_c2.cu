// FP8 varlen-K grouped GEMM, the weight gradients (fp8_grouped_gemm.hpp), on clusters of 2 CTAs
// along N: cooperative 128 x 128 x 128 tiles with 1x128 scales on both operands, each pair
// computing two N tiles of the same M rows, A's tiles loaded once per pair by TMA multicast.
#include "cuda/gemm/fp8_grouped_gemm.hpp"
#include "cuda/gemm/kernels/sm90_tma_grouped_fp8.cuh"

namespace moeblaze::cuda::gemm::fp8::detail {

namespace {
using Gemm = tma::Fp8GroupedGemm<cute::Shape<cute::_128, cute::_128, cute::_128>,
                                 cute::Shape<cute::_1, cute::_2, cute::_1>,
                                 tma::Fp8RowScaleConfig>;
}  // namespace

size_t varlen_k_c2_scratch_bytes(int E) { return Gemm::scratch_bytes(E); }

void varlen_k_c2(const int32_t* poff, int E, int M, int N, const uint8_t* qa, const float* sa,
                 const uint8_t* qb, const float* sb, bf16* d, void* scratch, size_t scratch_bytes,
                 cudaStream_t stream) {
  tma::run_fp8_varlen_k<Gemm>("fp8::varlen_k (cluster 2)", poff, E, M, N, qa, sa, qb, sb, d,
                              scratch, scratch_bytes, stream);
}

}  // namespace moeblaze::cuda::gemm::fp8::detail
