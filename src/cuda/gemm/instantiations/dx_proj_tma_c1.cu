// (6) dX̃ on the TMA path with single-CTA clusters (the `dx.cluster=1` kernel override):
// tma::GroupedGemm<RowMajor> with a 1x1x1 cluster, as dx_proj_tma.cu otherwise.
#include "cuda/gemm/kernels/sm90_tma_grouped.cuh"
#include "cuda/gemm/dispatch/tma_paths.hpp"

namespace moeblaze::cuda::gemm::detail {

using DxGemm1 = tma::GroupedGemm<cutlass::layout::RowMajor, tma::TileShape,
                                 cute::Shape<cute::_1, cute::_1, cute::_1>>;

size_t dx_proj_tma_c1_scratch_bytes(int E) {
  const TmaTileOrder o = tma_tile_order();
  return DxGemm1::scratch_bytes(E, {o.along_n, o.swizzle});
}

void dx_proj_tma_c1(const ExpertRows& rows, int E, const bf16* dh, const bf16* w1,
                    bf16* dx_slots, int64_t d, int64_t w1_rows, GemmScratch scratch,
                    cudaStream_t stream) {
  const TmaTileOrder order = tma_tile_order();
  tma::run<DxGemm1>("dx_proj", rows, E, dh, w1_rows, w1, w1_rows * d, d, dx_slots, d,
                    static_cast<int>(d), static_cast<int>(w1_rows), scratch.data, scratch.bytes,
                    {order.along_n, order.swizzle}, stream);
}

}  // namespace moeblaze::cuda::gemm::detail
