// (5) dW2 on the warp-specialised varlen-K kernel, ping-pong (sm90_ws_varlen_k.cuh, kPingPong:
// each consumer warpgroup alone on 64 x 256 tiles, leaving by TMA store; clusters of 2 CTAs
// sharing a_scaled's stages by TMA multicast).
// Operands as in dw2_proj_ws.cu. One instantiation: varlen_k_ws_kernel<false, 2, true, true>
// (the dw2.schedule=pingpong,dw2.cluster=2 override).
#include "cuda/gemm/kernels/sm90_ws_varlen_k.cuh"
#include "cuda/gemm/dispatch/raster.hpp"
#include "cuda/gemm/dispatch/ws_paths.hpp"

namespace moeblaze::cuda::gemm::detail {

void dw2_proj_ws_pp_c2(const RoutingPlanView& plan, const bf16* d_out, const bf16* a_scaled,
                       bf16* dw2, int64_t d, int64_t n, cudaStream_t stream) {
  // d_out (T, d) gathered: M = d; a_scaled (S, n): N = n; dw2 (E, d, n).
  sm90::ws::launch_varlen_k_ws<false, 2, true, true>(
      sm90::ws::varlen_k_args(plan, d_out, a_scaled, d, n, dw2), plan.S, sm90::raster_group(),
      stream);
}

}  // namespace moeblaze::cuda::gemm::detail
