// (1) up-projection on the warp-specialised persistent path (sm90_ws_gather.cuh): 128 x 256
// tiles, A = x gathered through expert_token_indices by the producer warpgroup's cp.async, B = w1
// by TMA. For gated activations a tile's 256 B rows are 128 gate rows j and the 128 up rows
// n + j of the same j (Args::gate_split), so each consumer thread holds g and u of the same
// column j: fragment column groups i and i + 16. One instantiation:
// gather_gemm_kernel<K-major B, WsActEpilogue>.
#include "cuda/gemm/sm90_ws_gather.cuh"
#include "cuda/gemm/ws_paths.hpp"

namespace moeblaze::cuda::gemm {
namespace sm90::ws {

// h (S, w1_rows) and a (S, n), both bf16, from the fp32 accumulators; either may be null.
struct WsActEpilogue {
  struct Params {
    __nv_bfloat16* h;
    __nv_bfloat16* a;
    int n;
    Activation act;
  };
  __device__ static void at_tile_start(const Params&, int, int, int) {}
  template <class Acc>
  __device__ static void apply(const Params& p, Acc& acc, int m_begin, int m_end, int n_tile) {
    dispatch_activation(p.act,
                        [&](auto a) { body<decltype(a)::value>(p, acc, m_begin, m_end, n_tile); });
  }

  template <Activation A, class Acc>
  __device__ static void body(const Params& p, Acc& acc, int m_begin, int m_end, int n_tile) {
    constexpr bool kGated = A == Activation::swiglu || A == Activation::geglu;
    const int64_t w1_rows = kGated ? 2 * int64_t(p.n) : p.n;
#pragma unroll
    for (int v1 = 0; v1 < 2; ++v1) {
      const int slot = m_begin + ws_frag_row(v1);
      if (slot >= m_end) continue;
      __nv_bfloat16* h_row = p.h ? p.h + int64_t(slot) * w1_rows : nullptr;
      __nv_bfloat16* a_row = p.a ? p.a + int64_t(slot) * p.n : nullptr;
      if constexpr (kGated) {
        constexpr int kHalf = kFragColGroups / 2;  // gate groups 0..15, up groups 16..31
        const int j0 = n_tile * (kBN / 2);
#pragma unroll
        for (int i = 0; i < kHalf; ++i) {
          const int j = j0 + ws_frag_col(i);
          if (j >= p.n) continue;  // n % 128 == 64: the last tile's second half
          const float g0 = acc(4 * i + 2 * v1), g1 = acc(4 * i + 2 * v1 + 1);
          const float u0 = acc(4 * (i + kHalf) + 2 * v1), u1 = acc(4 * (i + kHalf) + 2 * v1 + 1);
          if (h_row) {
            store_bf16x2(h_row + j, g0, g1);
            store_bf16x2(h_row + p.n + j, u0, u1);
          }
          if (a_row) store_bf16x2(a_row + j, dev_act(A, g0) * u0, dev_act(A, g1) * u1);
        }
      } else {
        const int n0 = n_tile * kBN;
#pragma unroll
        for (int i = 0; i < kFragColGroups; ++i) {
          const int j = n0 + ws_frag_col(i);
          if (j >= p.n) continue;
          const float h0 = acc(4 * i + 2 * v1), h1 = acc(4 * i + 2 * v1 + 1);
          if (h_row) store_bf16x2(h_row + j, h0, h1);
          if (a_row) store_bf16x2(a_row + j, dev_act(A, h0), dev_act(A, h1));
        }
      }
    }
  }
};

}  // namespace sm90::ws

namespace detail {

bool ws_gather_supports(int64_t E) { return E >= 1 && E <= sm90::ws::kMaxExperts; }

void up_proj_ws(const RoutingPlanView& plan, const bf16* x, const bf16* w1, bf16* h, bf16* a,
                int64_t d, int64_t n, Activation act, cudaStream_t stream) {
  namespace ws = sm90::ws;
  const bool gated = is_gated(act);
  ws::Args p{};
  p.a = reinterpret_cast<const __nv_bfloat16*>(x);  // (T, d), rows gathered per slot
  p.lda = d;
  p.gather = plan.expert_token_indices;
  p.offsets = plan.expert_token_offsets;
  p.E = static_cast<int>(plan.E);
  p.K = static_cast<int>(d);
  p.n_tiles = static_cast<int>(gated ? (n + ws::kBN / 2 - 1) / (ws::kBN / 2)
                                     : (n + ws::kBN - 1) / ws::kBN);
  p.b_rows_per_expert = static_cast<int>(gated ? 2 * n : n);  // w1 (E, w1_rows, d): K-major
  p.b_cols = static_cast<int>(d);
  p.gate_split = gated ? static_cast<int>(n) : 0;
  ws::WsActEpilogue::Params ep{reinterpret_cast<__nv_bfloat16*>(h),
                               reinterpret_cast<__nv_bfloat16*>(a), static_cast<int>(n), act};
  ws::launch_gather_gemm<sm90::GMajor::K, ws::WsActEpilogue>(p, w1, ep, plan.S, stream);
}

}  // namespace detail
}  // namespace moeblaze::cuda::gemm
