// (8) dW1 on the warp-specialised varlen-K kernel's wide cooperative tile, transposed
// (sm90_ws_varlen_k.cuh, kWide: 256 gathered rows of d x 128 columns of w1_rows, on clusters of
// 2 that share dh by TMA multicast). Orientation and operands as in dw1_proj_ws.cu. One
// instantiation: varlen_k_ws_kernel<true, 2, false, false, true> (the dw1.tile=256x128 override).
#include "cuda/gemm/kernels/sm90_ws_varlen_k.cuh"
#include "cuda/gemm/dispatch/raster.hpp"
#include "cuda/gemm/dispatch/ws_paths.hpp"

namespace moeblaze::cuda::gemm::detail {

void dw1_proj_ws_wide(const RoutingPlanView& plan, const bf16* dh, const bf16* x, bf16* dw1,
                      int64_t d, int64_t w1_rows, cudaStream_t stream) {
  // x (T, d) gathered: M = d; dh (S, w1_rows): N = w1_rows; dw1 (E, w1_rows, d) = (E, N, M).
  sm90::ws::launch_varlen_k_ws<true, 2, false, false, true>(
      sm90::ws::varlen_k_args(plan, x, dh, d, w1_rows, dw1), plan.S, sm90::raster_group(),
      stream);
}

}  // namespace moeblaze::cuda::gemm::detail
