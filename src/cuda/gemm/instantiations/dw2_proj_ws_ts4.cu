// (5) dW2 on the warp-specialised varlen-K kernel with the TMA-store epilogue in two pieces
// (sm90_ws_varlen_k.cuh, kTmaStore, kPieces = 2: a 32 KiB staging tile, each warpgroup's half
// leaving as two 64 x 128 pieces, so the ring keeps 4 stages). Operands as in dw2_proj_ws.cu.
// One instantiation: varlen_k_ws_kernel<false, 1, true, 2> (the dw2.stages=4 override).
#include "cuda/gemm/kernels/sm90_ws_varlen_k.cuh"
#include "cuda/gemm/dispatch/raster.hpp"
#include "cuda/gemm/dispatch/ws_paths.hpp"

namespace moeblaze::cuda::gemm::detail {

// The ring depth the kernel builds is the one the kernel choice reports (GemmKernel::stages).
static_assert(sm90::ws::kVkTmaStore2Stages == kWsVarlenKTmaStore2Stages);

void dw2_proj_ws_ts4(const RoutingPlanView& plan, const bf16* d_out, const bf16* a_scaled,
                     bf16* dw2, int64_t d, int64_t n, cudaStream_t stream) {
  // d_out (T, d) gathered: M = d; a_scaled (S, n): N = n; dw2 (E, d, n).
  sm90::ws::launch_varlen_k_ws<false, 1, true, 2>(
      sm90::ws::varlen_k_args(plan, d_out, a_scaled, d, n, dw2), plan.S, sm90::raster_group(),
      stream);
}

}  // namespace moeblaze::cuda::gemm::detail
