// (6) dX̃ on the TMA path: dx_slots = dh · w1_e per expert, B = w1_e (w1_rows, d) is (K, N) with
// N contiguous (CUTLASS RowMajor). One instantiation here, tma::GroupedGemm<RowMajor> on clusters
// of 2; the cluster-1 build is dx_proj_tma_c1.cu's.
#include <algorithm>

#include "cuda/gemm/kernels/sm90_tma_grouped.cuh"
#include "cuda/gemm/dispatch/tma_paths.hpp"

namespace moeblaze::cuda::gemm::detail {

using DxGemm = tma::GroupedGemm<cutlass::layout::RowMajor>;

size_t dx_proj_tma_scratch_bytes(int E) {
  const TmaTileOrder o = tma_tile_order();
  return std::max(DxGemm::scratch_bytes(E, {o.along_n, o.swizzle}),
                  dx_proj_tma_c1_scratch_bytes(E));
}

void dx_proj_tma(const RoutingPlanView& plan, const ExpertRows& rows, const bf16* dh,
                 const bf16* w1, bf16* dx_slots, int64_t d, int64_t w1_rows, int cluster,
                 GemmScratch scratch, cudaStream_t stream) {
  if (plan.S == 0) return;
  const int E = static_cast<int>(plan.E);
  if (cluster == 1) {
    dx_proj_tma_c1(rows, E, dh, w1, dx_slots, d, w1_rows, scratch, stream);
    return;
  }
  const TmaTileOrder order = tma_tile_order();
  // dh (S, w1_rows): lda = w1_rows; w1 (E, w1_rows, d): ldb = d; dx_slots (rows, d): ldd = d.
  tma::run<DxGemm>("dx_proj", rows, E, dh, w1_rows, w1, w1_rows * d, d, dx_slots, d,
                   static_cast<int>(d), static_cast<int>(w1_rows), scratch.data, scratch.bytes,
                   {order.along_n, order.swizzle}, stream);
}

}  // namespace moeblaze::cuda::gemm::detail
