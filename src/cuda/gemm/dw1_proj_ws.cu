// (8) dW1 on the warp-specialised persistent varlen-K kernel (sm90_ws_varlen_k.cuh), computed
// transposed: dW1[e]ᵀ (d, w1_rows) = sum over slots of x[token]ᵀ ⊗ dh[slot], so that the
// gathered operand x is the 128-wide P (8 cp.async per producer thread and stage) and dh, the
// contiguous 256-wide Q, comes by TMA; the epilogue stores the tile transposed into
// dw1 (E, w1_rows, d). (The direct orientation, x as the 256-wide gathered Q, measured 8-11 %
// faster than the 2-CTA kernel; dW2, whose gathered operand is the 128-wide one, 32-50 %.)
// One instantiation: varlen_k_ws_kernel<true>.
#include "cuda/gemm/sm90_ws_varlen_k.cuh"
#include "cuda/gemm/ws_paths.hpp"

namespace moeblaze::cuda::gemm::detail {

void dw1_proj_ws(const RoutingPlanView& plan, const bf16* dh, const bf16* x, bf16* dw1,
                 int64_t d, int64_t w1_rows, cudaStream_t stream) {
  sm90::ws::VarlenKArgs a{};
  a.p = reinterpret_cast<const __nv_bfloat16*>(x);   // (T, d): M = d, rows gathered
  a.q = reinterpret_cast<const __nv_bfloat16*>(dh);  // (S, w1_rows): N = w1_rows, rows = slots
  a.gather = plan.expert_token_indices;
  a.offsets = plan.expert_token_offsets;
  a.E = static_cast<int>(plan.E);
  a.M = static_cast<int>(d);
  a.N = static_cast<int>(w1_rows);
  a.out = reinterpret_cast<__nv_bfloat16*>(dw1);  // (E, w1_rows, d) = (E, N, M)
  sm90::ws::launch_varlen_k_ws<true>(a, plan.S, stream);
}

}  // namespace moeblaze::cuda::gemm::detail
