// (5) dW2 on the warp-specialised varlen-K kernel, ping-pong (sm90_ws_varlen_k.cuh, kPingPong:
// each consumer warpgroup alone on 128 x 192 tiles, 16-byte stores).
// Operands as in dw2_proj_ws.cu. One instantiation: varlen_k_ws_kernel<false, 1, false, true>
// (the dw2.schedule=pingpong override).
#include "cuda/gemm/kernels/sm90_ws_varlen_k.cuh"
#include "cuda/gemm/dispatch/raster.hpp"
#include "cuda/gemm/dispatch/ws_paths.hpp"

namespace moeblaze::cuda::gemm::detail {

// The ring depth the kernel builds is the one the kernel choice reports (GemmKernel::stages).
static_assert(sm90::ws::kVkPingPongStages == kWsVarlenKPingPongStages);
static_assert(sm90::ws::kVkPingPongTileM == kWsVarlenKPingPongTileM &&
              sm90::ws::kVkPingPongTileN == kWsVarlenKPingPongTileN);

void dw2_proj_ws_pp(const RoutingPlanView& plan, const bf16* d_out, const bf16* a_scaled,
                    bf16* dw2, int64_t d, int64_t n, cudaStream_t stream) {
  // d_out (T, d) gathered: M = d; a_scaled (S, n): N = n; dw2 (E, d, n).
  sm90::ws::launch_varlen_k_ws<false, 1, false, true>(
      sm90::ws::varlen_k_args(plan, d_out, a_scaled, d, n, dw2), plan.S, sm90::raster_group(),
      stream);
}

}  // namespace moeblaze::cuda::gemm::detail
