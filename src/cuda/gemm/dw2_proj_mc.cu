// (5) dW2 on the varlen-K kernel's 2-CTA cluster variant (sm90_ws_varlen_k.cuh, kCluster = 2):
// the two CTAs of a cluster compute m-tiles 2g, 2g + 1 of dW2[e] for one n-tile and share
// a_scaled's stage by TMA multicast. Operands as in dw2_proj_ws.cu.
// One instantiation: varlen_k_ws_kernel<false, 2>.
#include "cuda/gemm/sm90_ws_varlen_k.cuh"
#include "cuda/gemm/ws_paths.hpp"

namespace moeblaze::cuda::gemm::detail {

void dw2_proj_ws_cluster(const RoutingPlanView& plan, const bf16* d_out, const bf16* a_scaled,
                         bf16* dw2, int64_t d, int64_t n, cudaStream_t stream) {
  // d_out (T, d) gathered: M = d; a_scaled (S, n): N = n; dw2 (E, d, n).
  sm90::ws::launch_varlen_k_ws<false, 2>(
      sm90::ws::varlen_k_args(plan, d_out, a_scaled, d, n, dw2), plan.S, stream);
}

}  // namespace moeblaze::cuda::gemm::detail
