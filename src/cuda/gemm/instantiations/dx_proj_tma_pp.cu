// (6) dX̃ on the TMA path, variant 3 of kTmaVariants (dispatch/tma_paths.hpp): dx_slots = dh · w1_e
// per expert, B = w1_e (w1_rows, d) is (K, N) with N contiguous (CUTLASS RowMajor); 192x128
// ping-pong (each consumer warpgroup on its own tile, one's epilogue under the other's mainloop) on
// clusters of 2 along N (`<gemm>.tile=192x128`).
#include "cuda/gemm/kernels/sm90_tma_grouped.cuh"
#include "cuda/gemm/dispatch/tma_paths.hpp"

namespace moeblaze::cuda::gemm::detail {

using DxGemm3 =
    tma::GroupedGemm<cutlass::layout::RowMajor, cute::Shape<cute::_192, cute::_128, cute::_64>,
                     cute::Shape<cute::_1, cute::_2, cute::_1>, tma::PingPong>;

template <>
size_t dx_tma_scratch_bytes<3>(int E, TmaTileOrder order) {
  return DxGemm3::scratch_bytes(E, order);
}

template <>
void dx_tma_run<3>(const TmaCall& call) {
  tma::run<DxGemm3>(call);
}

}  // namespace moeblaze::cuda::gemm::detail
