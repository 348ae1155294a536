// (6) dX̃ on the TMA path, variant 4 of kTmaVariants (dispatch/tma_paths.hpp): dx_slots = dh · w1_e
// per expert, B = w1_e (w1_rows, d) is (K, N) with N contiguous (CUTLASS RowMajor); 128x192
// ping-pong (SonicMoE's pick where d is a multiple of 192) on clusters of 2 along N
// (`<gemm>.tile=128x192`).
#include "cuda/gemm/kernels/sm90_tma_grouped.cuh"
#include "cuda/gemm/dispatch/tma_paths.hpp"

namespace moeblaze::cuda::gemm::detail {

using DxGemm4 =
    tma::GroupedGemm<cutlass::layout::RowMajor, cute::Shape<cute::_128, cute::_192, cute::_64>,
                     cute::Shape<cute::_1, cute::_2, cute::_1>, tma::PingPong>;

template <>
size_t dx_tma_scratch_bytes<4>(int E, TmaTileOrder order) {
  return DxGemm4::scratch_bytes(E, order);
}

template <>
void dx_tma_run<4>(const TmaCall& call) {
  tma::run<DxGemm4>(call);
}

}  // namespace moeblaze::cuda::gemm::detail
