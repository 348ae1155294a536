// (8) dW1 on the warp-specialised persistent varlen-K kernel (sm90_ws_varlen_k.cuh), computed
// transposed: dW1[e]ᵀ (d, w1_rows) = sum over slots of x[token]ᵀ ⊗ dh[slot], so that the
// gathered operand x is the 128-wide P (8 cp.async per producer thread and stage) and dh, the
// contiguous 256-wide Q, comes by TMA; the epilogue stores the tile transposed into
// dw1 (E, w1_rows, d). (Transposed because a 256-wide gathered operand leaves the producer the
// bottleneck; docs/notes/gathered-gemms.md.)
// This file: one CTA per tile, varlen_k_ws_kernel<true, 1>; the 2-CTA cluster variant, for
// experts with many rows (the chosen kernel's cluster = 2), is in dw1_proj_mc.cu.
#include "cuda/gemm/kernels/sm90_ws_varlen_k.cuh"
#include "cuda/gemm/dispatch/raster.hpp"
#include "cuda/gemm/dispatch/ws_paths.hpp"

namespace moeblaze::cuda::gemm::detail {

void dw1_proj_ws(const RoutingPlanView& plan, const bf16* dh, const bf16* x, bf16* dw1,
                 int64_t d, int64_t w1_rows, int cluster, bool store_by_tma,
                 cudaStream_t stream) {
  if (store_by_tma) {  // one CTA a tile (the override refuses clusters with it)
    dw1_proj_ws_ts(plan, dh, x, dw1, d, w1_rows, stream);
    return;
  }
  if (cluster == 2) {
    dw1_proj_ws_cluster(plan, dh, x, dw1, d, w1_rows, stream);
    return;
  }
  // x (T, d) gathered: M = d; dh (S, w1_rows): N = w1_rows; dw1 (E, w1_rows, d) = (E, N, M).
  sm90::ws::launch_varlen_k_ws<true, 1>(sm90::ws::varlen_k_args(plan, x, dh, d, w1_rows, dw1),
                                        plan.S, sm90::raster_group(), stream);
}

}  // namespace moeblaze::cuda::gemm::detail
