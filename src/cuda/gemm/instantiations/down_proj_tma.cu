// (2) down-projection on the TMA path: y = a · w2_eᵀ per expert, B = w2_e (d, n) is (N, K) with
// K contiguous (CUTLASS ColumnMajor). One instantiation: tma::GroupedGemm<ColumnMajor>.
#include "cuda/gemm/kernels/sm90_tma_grouped.cuh"
#include "cuda/gemm/dispatch/tma_paths.hpp"

namespace moeblaze::cuda::gemm::detail {

using DownGemm = tma::GroupedGemm<cutlass::layout::ColumnMajor>;

size_t down_proj_tma_scratch_bytes(int E) {
  const TmaTileOrder o = tma_tile_order();
  return DownGemm::scratch_bytes(E, {o.along_n, o.swizzle});
}

void down_proj_tma(const RoutingPlanView& plan, const ExpertRows& rows, const bf16* a,
                   const bf16* w2, bf16* y, int64_t d, int64_t n, GemmScratch scratch,
                   cudaStream_t stream) {
  if (plan.S == 0) return;
  const TmaTileOrder order = tma_tile_order();
  // a (S, n): lda = n; w2 (E, d, n): d * n per expert, ldb = n; y (rows, d): ldd = d.
  tma::run<DownGemm>("down_proj", rows, static_cast<int>(plan.E), a, n, w2,
                     d * n, n, y, d, static_cast<int>(d), static_cast<int>(n), scratch.data,
                     scratch.bytes, {order.along_n, order.swizzle}, stream);
}

}  // namespace moeblaze::cuda::gemm::detail
