// (6) dX̃ on the TMA path, variant 2 of kTmaVariants (dispatch/tma_paths.hpp): dx_slots = dh · w1_e
// per expert, B = w1_e (w1_rows, d) is (K, N) with N contiguous (CUTLASS RowMajor); 256x128
// cooperative on clusters of 2 along N (the activation panel multicast; `<gemm>.tile=256x128`).
#include "cuda/gemm/kernels/sm90_tma_grouped.cuh"
#include "cuda/gemm/dispatch/tma_paths.hpp"

namespace moeblaze::cuda::gemm::detail {

using DxGemm2 =
    tma::GroupedGemm<cutlass::layout::RowMajor, cute::Shape<cute::_256, cute::_128, cute::_64>,
                     cute::Shape<cute::_1, cute::_2, cute::_1>, tma::Cooperative>;

template <>
size_t dx_tma_scratch_bytes<2>(int E, TmaTileOrder order) {
  return DxGemm2::scratch_bytes(E, order);
}

template <>
void dx_tma_run<2>(const TmaCall& call) {
  tma::run<DxGemm2>(call);
}

}  // namespace moeblaze::cuda::gemm::detail
