// (2) down-projection on the TMA path, variant 1 of kTmaVariants (dispatch/tma_paths.hpp): y = a ·
// w2_eᵀ per expert, B = w2_e (d, n) is (N, K) with K contiguous (CUTLASS ColumnMajor); 128x256
// cooperative on single CTAs (the `<gemm>.cluster=1` override).
#include "cuda/gemm/kernels/sm90_tma_grouped.cuh"
#include "cuda/gemm/dispatch/tma_paths.hpp"

namespace moeblaze::cuda::gemm::detail {

using DownGemm1 =
    tma::GroupedGemm<cutlass::layout::ColumnMajor, tma::TileShape,
                     cute::Shape<cute::_1, cute::_1, cute::_1>, tma::Cooperative>;

template <>
size_t down_tma_scratch_bytes<1>(int E, TmaTileOrder order) {
  return DownGemm1::scratch_bytes(E, order);
}

template <>
void down_tma_run<1>(const TmaCall& call) {
  tma::run<DownGemm1>(call);
}

}  // namespace moeblaze::cuda::gemm::detail
