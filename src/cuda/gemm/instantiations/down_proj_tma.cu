// (2) down-projection on the TMA path: y = a · w2_eᵀ per expert, B = w2_e (d, n) is (N, K) with
// K contiguous (CUTLASS ColumnMajor). One instantiation here, tma::GroupedGemm<ColumnMajor> on
// clusters of 2; the cluster-1 build is down_proj_tma_c1.cu's.
#include <algorithm>

#include "cuda/gemm/kernels/sm90_tma_grouped.cuh"
#include "cuda/gemm/dispatch/tma_paths.hpp"

namespace moeblaze::cuda::gemm::detail {

using DownGemm = tma::GroupedGemm<cutlass::layout::ColumnMajor>;

size_t down_proj_tma_scratch_bytes(int E) {
  const TmaTileOrder o = tma_tile_order();
  return std::max(DownGemm::scratch_bytes(E, {o.along_n, o.swizzle}),
                  down_proj_tma_c1_scratch_bytes(E));
}

void down_proj_tma(const RoutingPlanView& plan, const ExpertRows& rows, const bf16* a,
                   const bf16* w2, bf16* y, int64_t d, int64_t n, int cluster,
                   GemmScratch scratch, cudaStream_t stream) {
  if (plan.S == 0) return;
  const int E = static_cast<int>(plan.E);
  if (cluster == 1) {
    down_proj_tma_c1(rows, E, a, w2, y, d, n, scratch, stream);
    return;
  }
  const TmaTileOrder order = tma_tile_order();
  // a (S, n): lda = n; w2 (E, d, n): d * n per expert, ldb = n; y (rows, d): ldd = d.
  tma::run<DownGemm>("down_proj", rows, E, a, n, w2, d * n, n, y, d, static_cast<int>(d),
                     static_cast<int>(n), scratch.data, scratch.bytes,
                     {order.along_n, order.swizzle}, stream);
}

}  // namespace moeblaze::cuda::gemm::detail
