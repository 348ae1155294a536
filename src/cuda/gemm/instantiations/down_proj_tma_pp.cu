// (2) down-projection on the TMA path, variant 3 of kTmaVariants (dispatch/tma_paths.hpp): y = a ·
// w2_eᵀ per expert, B = w2_e (d, n) is (N, K) with K contiguous (CUTLASS ColumnMajor); 192x128
// ping-pong (each consumer warpgroup on its own tile, one's epilogue under the other's mainloop) on
// clusters of 2 along N (`<gemm>.tile=192x128`).
#include "cuda/gemm/kernels/sm90_tma_grouped.cuh"
#include "cuda/gemm/dispatch/tma_paths.hpp"

namespace moeblaze::cuda::gemm::detail {

using DownGemm3 =
    tma::GroupedGemm<cutlass::layout::ColumnMajor, cute::Shape<cute::_192, cute::_128, cute::_64>,
                     cute::Shape<cute::_1, cute::_2, cute::_1>, tma::PingPong>;

template <>
size_t down_tma_scratch_bytes<3>(int E, TmaTileOrder order) {
  return DownGemm3::scratch_bytes(E, order);
}

template <>
void down_tma_run<3>(const TmaCall& call) {
  tma::run<DownGemm3>(call);
}

}  // namespace moeblaze::cuda::gemm::detail
