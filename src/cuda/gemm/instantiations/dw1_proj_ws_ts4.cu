// (8) dW1 on the warp-specialised varlen-K kernel, transposed, with the TMA-store epilogue in two
// pieces (sm90_ws_varlen_k.cuh, kTmaStore, kPieces = 2; 4 ring stages). Orientation and operands
// as in dw1_proj_ws.cu. One instantiation: varlen_k_ws_kernel<true, 1, true, 2> (the
// dw1.stages=4 override, with dw1.cluster=1).
#include "cuda/gemm/kernels/sm90_ws_varlen_k.cuh"
#include "cuda/gemm/dispatch/raster.hpp"
#include "cuda/gemm/dispatch/ws_paths.hpp"

namespace moeblaze::cuda::gemm::detail {

void dw1_proj_ws_ts4(const RoutingPlanView& plan, const bf16* dh, const bf16* x, bf16* dw1,
                     int64_t d, int64_t w1_rows, cudaStream_t stream) {
  // x (T, d) gathered: M = d; dh (S, w1_rows): N = w1_rows; dw1 (E, w1_rows, d) = (E, N, M).
  sm90::ws::launch_varlen_k_ws<true, 1, true, 2>(
      sm90::ws::varlen_k_args(plan, x, dh, d, w1_rows, dw1), plan.S, sm90::raster_group(),
      stream);
}

}  // namespace moeblaze::cuda::gemm::detail
