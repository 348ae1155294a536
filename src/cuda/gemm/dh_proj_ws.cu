// (4) dH on the warp-specialised persistent path (sm90_ws_gather.cuh): 128 x 256 tiles, A = d_out
// gathered through expert_token_indices by the producer warpgroup's cp.async, B = w2 by TMA
// (N-major: the 2D view (E * d, n), boxes of 64 n-columns x 64 d-rows). The epilogue is the
// 2-CTA kernel's (dh_proj.cu, DhEpilogue) on the 64 x 256 fragment: it reads the tile's H, which
// at_tile_start has asked L2 to prefetch before the mainloop, recomputes a, writes dh and s·a
// and two ds partials per (slot, tile), one per 128 columns, the same columns the 2-CTA kernel
// gives each partial (so reduce_ds and ds_partials_cols are shared). One instantiation:
// gather_gemm_kernel<N-major B, WsDhEpilogue>.
#include "cuda/gemm/dh_epilogue.cuh"
#include "cuda/gemm/sm90_ws_gather.cuh"
#include "cuda/gemm/ws_paths.hpp"

namespace moeblaze::cuda::gemm {
namespace sm90::ws {

struct WsDhEpilogue {
  using Params = DhParams;
  // The H lines this tile's epilogue reads, into L2 while the mainloop runs: row r of the tile
  // needs 512 bytes of g (and of u) = four 128-byte lines; the 4 lanes that share a row take
  // one line each.
  __device__ static void at_tile_start(const Params& p, int m_begin, int m_end, int n_tile) {
    const int64_t w1_rows = p.gated ? 2 * int64_t(p.n) : p.n;
    const int j = n_tile * kBN + 64 * (threadIdx.x & 3);
    if (j >= p.n) return;
#pragma unroll
    for (int v1 = 0; v1 < 2; ++v1) {
      const int slot = m_begin + ws_frag_row(v1);
      if (slot >= m_end) continue;
      const __nv_bfloat16* hr = p.h + int64_t(slot) * w1_rows + j;
      asm volatile("prefetch.global.L2 [%0];" ::"l"(hr));
      if (p.gated) asm volatile("prefetch.global.L2 [%0];" ::"l"(hr + p.n));
    }
  }

  template <class Acc>
  __device__ static void apply(const Params& p, Acc& acc, int m_begin, int m_end, int n_tile) {
    dispatch_activation(p.act,
                        [&](auto a) { body<decltype(a)::value>(p, acc, m_begin, m_end, n_tile); });
  }

  // Column groups are processed in chunks of 8 (64 columns): the H loads of a chunk are issued
  // together. (A software-pipelined variant, the next chunk's loads in flight while this one is
  // stored, measured 25-35 % slower on the H200: bench/NOTES.md.)
  static constexpr int kChunk = 8;
  static constexpr int kHalf = kFragColGroups / 2;  // groups of one ds partial (128 columns)

  template <Activation A, class Acc>
  __device__ static void body(const Params& p, Acc& acc, int m_begin, int m_end, int n_tile) {
    constexpr bool kGated = A == Activation::swiglu || A == Activation::geglu;
    const int64_t w1_rows = kGated ? 2 * int64_t(p.n) : p.n;
    const int n0 = n_tile * kBN;
    const __nv_bfloat162 zero = __floats2bfloat162_rn(0.0f, 0.0f);
#pragma unroll
    for (int v1 = 0; v1 < 2; ++v1) {
      const int slot = m_begin + ws_frag_row(v1);
      const bool row_ok = slot < m_end;
      const float s = row_ok ? __ldg(p.slot_weights + slot) : 0.0f;
      const int64_t row = row_ok ? slot : 0;
      const __nv_bfloat16* h_row = p.h + row * w1_rows;
      __nv_bfloat16* dh_row = p.dh + row * w1_rows;
      __nv_bfloat16* as_row = p.a_scaled + row * p.n;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        float part = 0.0f;  // this thread's share of sum_j da'_j a_j over the half's columns
#pragma unroll
        for (int c0 = half * kHalf; c0 < (half + 1) * kHalf; c0 += kChunk) {
          __nv_bfloat162 g[kChunk], u[kChunk];
#pragma unroll
          for (int q = 0; q < kChunk; ++q) {
            const int j = n0 + ws_frag_col(c0 + q);
            const bool ok = row_ok && j < p.n;  // n is a multiple of 64: pairs never straddle it
            g[q] = ok ? __ldg(reinterpret_cast<const __nv_bfloat162*>(h_row + j)) : zero;
            u[q] = ok && kGated
                       ? __ldg(reinterpret_cast<const __nv_bfloat162*>(h_row + p.n + j))
                       : zero;
          }
#pragma unroll
          for (int q = 0; q < kChunk; ++q) {
            const int i = c0 + q;
            const int j = n0 + ws_frag_col(i);
            if (!row_ok || j >= p.n) continue;
            dh_pair<A>(p, acc(4 * i + 2 * v1), acc(4 * i + 2 * v1 + 1), s, g[q], u[q], dh_row,
                       as_row, j, part);
          }
        }
        // The 4 lanes sharing a row hold the half's 128 columns; a fixed butterfly keeps the
        // order fixed (the same sum, in the same order, as DhEpilogue's for these columns).
        part += __shfl_xor_sync(0xffffffffu, part, 1);
        part += __shfl_xor_sync(0xffffffffu, part, 2);
        const int col = 2 * n_tile + half;
        if (row_ok && col < p.ds_cols && (threadIdx.x & 3) == 0)
          p.ds_partials[int64_t(slot) * p.ds_cols + col] = part;
      }
    }
  }
};

}  // namespace sm90::ws

namespace detail {

void dh_proj_ws(const RoutingPlanView& plan, const bf16* d_out, const bf16* w2, const bf16* h,
                float* ds_partials, bf16* dh, bf16* a_scaled, int64_t d, int64_t n,
                Activation act, cudaStream_t stream) {
  namespace ws = sm90::ws;
  ws::Args p = ws::gather_args(plan, d_out, d);  // d_out (T, d), rows gathered per slot
  p.n_tiles = static_cast<int>((n + ws::kBN - 1) / ws::kBN);
  p.b_rows_per_expert = static_cast<int>(d);  // w2 (E, d, n): K = d rows of N = n columns
  p.b_cols = static_cast<int>(n);
  p.gate_split = 0;
  const sm90::DhParams ep = sm90::make_dh_params(plan, h, ds_partials, dh, a_scaled, n, act);
  ws::launch_gather_gemm<sm90::GMajor::MN, ws::WsDhEpilogue>(p, w2, ep, plan.S, stream);
}

}  // namespace detail
}  // namespace moeblaze::cuda::gemm
