// (2) down-projection on the TMA path, variant 2 of kTmaVariants (dispatch/tma_paths.hpp): y = a ·
// w2_eᵀ per expert, B = w2_e (d, n) is (N, K) with K contiguous (CUTLASS ColumnMajor); 256x128
// cooperative on clusters of 2 along N (the activation panel multicast; `<gemm>.tile=256x128`).
#include "cuda/gemm/kernels/sm90_tma_grouped.cuh"
#include "cuda/gemm/dispatch/tma_paths.hpp"

namespace moeblaze::cuda::gemm::detail {

using DownGemm2 =
    tma::GroupedGemm<cutlass::layout::ColumnMajor, cute::Shape<cute::_256, cute::_128, cute::_64>,
                     cute::Shape<cute::_1, cute::_2, cute::_1>, tma::Cooperative>;

template <>
size_t down_tma_scratch_bytes<2>(int E, TmaTileOrder order) {
  return DownGemm2::scratch_bytes(E, order);
}

template <>
void down_tma_run<2>(const TmaCall& call) {
  tma::run<DownGemm2>(call);
}

}  // namespace moeblaze::cuda::gemm::detail
