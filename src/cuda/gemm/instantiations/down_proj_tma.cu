// (2) down-projection on the TMA path, variant 0 of kTmaVariants (dispatch/tma_paths.hpp): y = a ·
// w2_eᵀ per expert, B = w2_e (d, n) is (N, K) with K contiguous (CUTLASS ColumnMajor); 128x256
// cooperative on clusters of 2 along M (the weight panel multicast): the automatic choice.
#include "cuda/gemm/kernels/sm90_tma_grouped.cuh"
#include "cuda/gemm/dispatch/tma_paths.hpp"

namespace moeblaze::cuda::gemm::detail {

using DownGemm0 =
    tma::GroupedGemm<cutlass::layout::ColumnMajor, tma::TileShape,
                     tma::ClusterShape, tma::Cooperative>;

template <>
size_t down_tma_scratch_bytes<0>(int E, TmaTileOrder order) {
  return DownGemm0::scratch_bytes(E, order);
}

template <>
void down_tma_run<0>(const TmaCall& call) {
  tma::run<DownGemm0>(call);
}

}  // namespace moeblaze::cuda::gemm::detail
