// (2) down-projection on the TMA path, variant 4 of kTmaVariants (dispatch/tma_paths.hpp): y = a ·
// w2_eᵀ per expert, B = w2_e (d, n) is (N, K) with K contiguous (CUTLASS ColumnMajor); 128x192
// ping-pong (SonicMoE's pick where d is a multiple of 192 and K = n is short) on clusters of 2
// along N (`<gemm>.tile=128x192`).
#include "cuda/gemm/kernels/sm90_tma_grouped.cuh"
#include "cuda/gemm/dispatch/tma_paths.hpp"

namespace moeblaze::cuda::gemm::detail {

using DownGemm4 =
    tma::GroupedGemm<cutlass::layout::ColumnMajor, cute::Shape<cute::_128, cute::_192, cute::_64>,
                     cute::Shape<cute::_1, cute::_2, cute::_1>, tma::PingPong>;

template <>
size_t down_tma_scratch_bytes<4>(int E, TmaTileOrder order) {
  return DownGemm4::scratch_bytes(E, order);
}

template <>
void down_tma_run<4>(const TmaCall& call) {
  tma::run<DownGemm4>(call);
}

}  // namespace moeblaze::cuda::gemm::detail
