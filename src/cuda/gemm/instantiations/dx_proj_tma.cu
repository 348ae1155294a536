// (6) dX̃ on the TMA path, variant 0 of kTmaVariants (dispatch/tma_paths.hpp): dx_slots = dh · w1_e
// per expert, B = w1_e (w1_rows, d) is (K, N) with N contiguous (CUTLASS RowMajor); 128x256
// cooperative on clusters of 2 along M (the weight panel multicast): the automatic choice.
#include "cuda/gemm/kernels/sm90_tma_grouped.cuh"
#include "cuda/gemm/dispatch/tma_paths.hpp"

namespace moeblaze::cuda::gemm::detail {

using DxGemm0 =
    tma::GroupedGemm<cutlass::layout::RowMajor, tma::TileShape,
                     tma::ClusterShape, tma::Cooperative>;

template <>
size_t dx_tma_scratch_bytes<0>(int E, TmaTileOrder order) {
  return DxGemm0::scratch_bytes(E, order);
}

template <>
void dx_tma_run<0>(const TmaCall& call) {
  tma::run<DxGemm0>(call);
}

}  // namespace moeblaze::cuda::gemm::detail
