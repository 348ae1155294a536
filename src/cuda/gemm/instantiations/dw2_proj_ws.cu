// (5) dW2 on the warp-specialised persistent varlen-K kernel (sm90_ws_varlen_k.cuh): P = d_out
// gathered through expert_token_indices (M = d), Q = a_scaled contiguous by TMA (N = n).
// One instantiation: varlen_k_ws_kernel<false, 1> (one CTA per tile: dW2 is not L2-bound, so
// 2-CTA clusters sharing a_scaled do not pay;
// docs/notes/varlen-k-weight-gradients.md).
#include "cuda/gemm/kernels/sm90_ws_varlen_k.cuh"
#include "cuda/gemm/dispatch/raster.hpp"
#include "cuda/gemm/dispatch/ws_paths.hpp"

namespace moeblaze::cuda::gemm::detail {

void dw2_proj_ws(const RoutingPlanView& plan, const bf16* d_out, const bf16* a_scaled, bf16* dw2,
                 int64_t d, int64_t n, bool store_by_tma, cudaStream_t stream) {
  if (store_by_tma) {
    dw2_proj_ws_ts(plan, d_out, a_scaled, dw2, d, n, stream);
    return;
  }
  // d_out (T, d) gathered: M = d; a_scaled (S, n): N = n; dw2 (E, d, n).
  sm90::ws::launch_varlen_k_ws<false, 1>(
      sm90::ws::varlen_k_args(plan, d_out, a_scaled, d, n, dw2), plan.S, sm90::raster_group(),
      stream);
}

}  // namespace moeblaze::cuda::gemm::detail
