// (1) up-projection on the warp-specialised persistent path (sm90_ws_gather.cuh): 128 x 256
// tiles, A = x gathered through expert_token_indices by the producer warpgroup's cp.async, B = w1
// by TMA. For gated activations a tile's 256 B rows are 128 gate rows j and the 128 up rows
// n + j of the same j (Args::gate_split), so each consumer thread holds g and u of the same
// column j: fragment column groups i and i + 16. One instantiation:
// gather_gemm_kernel<K-major B, WsActEpilogue>.
#include "cuda/gemm/act_epilogue.cuh"
#include "cuda/gemm/sm90_ws_gather.cuh"
#include "cuda/gemm/ws_paths.hpp"

namespace moeblaze::cuda::gemm {
namespace sm90::ws {

// The warp-specialised kernel's side of the shared epilogue (act_epilogue.cuh).
struct WsActEpilogue {
  using Params = ActParams;
  __device__ static void at_tile_start(const Params&, int, int, int) {}
  template <class Acc>
  __device__ static void apply(const Params& p, Acc& acc, int m_begin, int m_end, int n_tile) {
    act_epilogue<WsFrag>(p, acc, m_begin, m_end, n_tile);
  }
};

}  // namespace sm90::ws

namespace detail {

bool ws_gather_supports(int64_t E) { return E >= 1 && E <= sm90::ws::kMaxExperts; }

void up_proj_ws(const RoutingPlanView& plan, const bf16* x, const bf16* w1, bf16* h, bf16* a,
                int64_t d, int64_t n, Activation act, cudaStream_t stream) {
  namespace ws = sm90::ws;
  const bool gated = is_gated(act);
  ws::Args p = ws::gather_args(plan, x, d);  // x (T, d), rows gathered per slot
  p.n_tiles = static_cast<int>(gated ? (n + ws::kBN / 2 - 1) / (ws::kBN / 2)
                                     : (n + ws::kBN - 1) / ws::kBN);
  p.b_rows_per_expert = static_cast<int>(gated ? 2 * n : n);  // w1 (E, w1_rows, d): K-major
  p.b_cols = static_cast<int>(d);
  p.gate_split = gated ? static_cast<int>(n) : 0;
  sm90::ActParams ep{reinterpret_cast<__nv_bfloat16*>(h),
                     reinterpret_cast<__nv_bfloat16*>(a), static_cast<int>(n), act};
  ws::launch_gather_gemm<sm90::GMajor::K, ws::WsActEpilogue>(p, w1, ep, plan.S, stream);
}

}  // namespace detail
}  // namespace moeblaze::cuda::gemm
