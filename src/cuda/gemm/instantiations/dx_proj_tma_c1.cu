// (6) dX̃ on the TMA path, variant 1 of kTmaVariants (dispatch/tma_paths.hpp): dx_slots = dh · w1_e
// per expert, B = w1_e (w1_rows, d) is (K, N) with N contiguous (CUTLASS RowMajor); 128x256
// cooperative on single CTAs (the `<gemm>.cluster=1` override).
#include "cuda/gemm/kernels/sm90_tma_grouped.cuh"
#include "cuda/gemm/dispatch/tma_paths.hpp"

namespace moeblaze::cuda::gemm::detail {

using DxGemm1 =
    tma::GroupedGemm<cutlass::layout::RowMajor, tma::TileShape,
                     cute::Shape<cute::_1, cute::_1, cute::_1>, tma::Cooperative>;

template <>
size_t dx_tma_scratch_bytes<1>(int E, TmaTileOrder order) {
  return DxGemm1::scratch_bytes(E, order);
}

template <>
void dx_tma_run<1>(const TmaCall& call) {
  tma::run<DxGemm1>(call);
}

}  // namespace moeblaze::cuda::gemm::detail
