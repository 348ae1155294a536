// (5) dW2 on the warp-specialised varlen-K kernel's wide cooperative tile (sm90_ws_varlen_k.cuh,
// kWide: 256 gathered rows of d, two warpgroups of 128, x 128 columns of n, on clusters of 2
// that share a' by TMA multicast). Operands as in dw2_proj_ws.cu. One instantiation:
// varlen_k_ws_kernel<false, 2, false, false, true> (the dw2.tile=256x128 override).
#include "cuda/gemm/kernels/sm90_ws_varlen_k.cuh"
#include "cuda/gemm/dispatch/raster.hpp"
#include "cuda/gemm/dispatch/ws_paths.hpp"

namespace moeblaze::cuda::gemm::detail {

// The tile the kernel builds is the one the kernel choice reports (GemmKernel::tile_m, tile_n).
static_assert(sm90::ws::kVkWideTileM == kWsVarlenKWideTileM &&
              sm90::ws::kVkWideTileN == kWsVarlenKWideTileN);

void dw2_proj_ws_wide(const RoutingPlanView& plan, const bf16* d_out, const bf16* a_scaled,
                      bf16* dw2, int64_t d, int64_t n, cudaStream_t stream) {
  // d_out (T, d) gathered: M = d; a_scaled (S, n): N = n; dw2 (E, d, n).
  sm90::ws::launch_varlen_k_ws<false, 2, false, false, true>(
      sm90::ws::varlen_k_args(plan, d_out, a_scaled, d, n, dw2), plan.S, sm90::raster_group(),
      stream);
}

}  // namespace moeblaze::cuda::gemm::detail
