// (2) down-projection on the TMA path with single-CTA clusters (the `down.cluster=1` kernel
// override): tma::GroupedGemm<ColumnMajor> with a 1x1x1 cluster, as down_proj_tma.cu otherwise.
#include "cuda/gemm/kernels/sm90_tma_grouped.cuh"
#include "cuda/gemm/dispatch/tma_paths.hpp"

namespace moeblaze::cuda::gemm::detail {

using DownGemm1 = tma::GroupedGemm<cutlass::layout::ColumnMajor, tma::TileShape,
                                   cute::Shape<cute::_1, cute::_1, cute::_1>>;

size_t down_proj_tma_c1_scratch_bytes(int E) {
  const TmaTileOrder o = tma_tile_order();
  return DownGemm1::scratch_bytes(E, {o.along_n, o.swizzle});
}

void down_proj_tma_c1(const ExpertRows& rows, int E, const bf16* a, const bf16* w2, bf16* y,
                      int64_t d, int64_t n, GemmScratch scratch, cudaStream_t stream) {
  const TmaTileOrder order = tma_tile_order();
  tma::run<DownGemm1>("down_proj", rows, E, a, n, w2, d * n, n, y, d, static_cast<int>(d),
                      static_cast<int>(n), scratch.data, scratch.bytes,
                      {order.along_n, order.swizzle}, stream);
}

}  // namespace moeblaze::cuda::gemm::detail
