// The two gathered GEMMs with fused epilogues on the warp-specialised kernel
// (sm90_ws_gather.cuh), for either schedule (Cooperative: 128 x 256 tiles shared by the two
// consumer warpgroups; PingPong: 128 x 128 tiles, one per warpgroup):
//   (1) up-projection: A = x gathered through expert_token_indices, B = w1 K-major by TMA, the
//       activation fused into the epilogue (act_epilogue.cuh). For gated activations a tile's
//       B rows are kTileN / 2 gate rows j and the kTileN / 2 up rows n + j of the same j
//       (Args::gate_split), so each consumer thread holds g and u of the same column j.
//   (4) dH: A = d_out gathered, B = w2 by TMA (N-major: the 2D view (E * d, n), boxes of 64
//       n-columns x 64 d-rows). The epilogue reads the tile's H (asked into L2 before the
//       mainloop), recomputes a, writes dh and s·a and one ds partial per (slot, 128 columns),
//       the columns the 2-CTA kernel gives each partial (so reduce_ds and ds_partials_cols are
//       shared).
// Each .cu file that includes this instantiates one (GEMM, schedule) pair (up_proj_ws.cu,
// up_proj_pp.cu, dh_proj_ws.cu, dh_proj_pp.cu).
#pragma once

#include "cuda/gemm/act_epilogue.cuh"
#include "cuda/gemm/dh_epilogue.cuh"
#include "cuda/gemm/sm90_ws_gather.cuh"

namespace moeblaze::cuda::gemm::sm90::ws {

// The up-projection's epilogue (act_epilogue.cuh) on fragment policy Frag.
template <class Frag>
struct GatherActEpilogue {
  using Params = ActParams;
  __device__ static void at_tile_start(const Params&, int, int, int) {}
  template <class Acc>
  __device__ static void apply(const Params& p, Acc& acc, int m_begin, int m_end, int n_tile) {
    act_epilogue<Frag>(p, acc, m_begin, m_end, n_tile);
  }
};

// The dH epilogue (dh_epilogue.cuh's dh_pair per column pair) on fragment policy Frag.
template <class Frag>
struct GatherDhEpilogue {
  using Params = DhParams;
  static constexpr int kPartials = Frag::kTileN / 128;  // ds partials per tile row
  static constexpr int kPartialGroups = 128 / 8;         // column groups of one partial
  // The H lines this tile's epilogue reads, into L2 while the mainloop runs: a tile row needs
  // kTileN / 64 128-byte lines of g (and as many of u); the 4 lanes that share a row split them.
  __device__ static void at_tile_start(const Params& p, int m_begin, int m_end, int n_tile) {
    constexpr int kLines = Frag::kTileN / 64;
    const int64_t w1_rows = p.gated ? 2 * int64_t(p.n) : p.n;
    for (int l = threadIdx.x & 3; l < (p.gated ? 2 : 1) * kLines; l += 4) {
      const int j = n_tile * Frag::kTileN + 64 * (l % kLines);
      if (j >= p.n) continue;
      const int64_t col = (l / kLines) * int64_t(p.n) + j;  // g, then u
#pragma unroll
      for (int r = 0; r < Frag::kRows; ++r) {
        const int slot = m_begin + Frag::row(r);
        if (slot < m_end)
          asm volatile("prefetch.global.L2 [%0];" ::"l"(p.h + int64_t(slot) * w1_rows + col));
      }
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

  template <Activation A, class Acc>
  __device__ static void body(const Params& p, Acc& acc, int m_begin, int m_end, int n_tile) {
    constexpr bool kGated = A == Activation::swiglu || A == Activation::geglu;
    const int64_t w1_rows = kGated ? 2 * int64_t(p.n) : p.n;
    const int n0 = n_tile * Frag::kTileN;
    const __nv_bfloat162 zero = __floats2bfloat162_rn(0.0f, 0.0f);
#pragma unroll
    for (int r = 0; r < Frag::kRows; ++r) {
      const int slot = m_begin + Frag::row(r);
      const bool row_ok = slot < m_end;
      const float s = row_ok ? __ldg(p.slot_weights + slot) : 0.0f;
      const int64_t row = row_ok ? slot : 0;
      const __nv_bfloat16* h_row = p.h + row * w1_rows;
      __nv_bfloat16* dh_row = p.dh + row * w1_rows;
      __nv_bfloat16* as_row = p.a_scaled + row * p.n;
#pragma unroll
      for (int half = 0; half < kPartials; ++half) {
        float part = 0.0f;  // this thread's share of sum_j da'_j a_j over the partial's columns
#pragma unroll
        for (int c0 = half * kPartialGroups; c0 < (half + 1) * kPartialGroups; c0 += kChunk) {
          __nv_bfloat162 g[kChunk], u[kChunk];
#pragma unroll
          for (int q = 0; q < kChunk; ++q) {
            const int j = n0 + Frag::col(c0 + q);
            const bool ok = row_ok && j < p.n;  // n is a multiple of 64: pairs never straddle it
            g[q] = ok ? __ldg(reinterpret_cast<const __nv_bfloat162*>(h_row + j)) : zero;
            u[q] = ok && kGated
                       ? __ldg(reinterpret_cast<const __nv_bfloat162*>(h_row + p.n + j))
                       : zero;
          }
#pragma unroll
          for (int q = 0; q < kChunk; ++q) {
            const int i = c0 + q;
            const int j = n0 + Frag::col(i);
            if (!row_ok || j >= p.n) continue;
            const int k = Frag::acc_index(r, i);
            dh_pair<A>(p, acc(k), acc(k + 1), s, g[q], u[q], dh_row, as_row, j, part);
          }
        }
        // The 4 lanes sharing a row hold the partial's 128 columns; a fixed butterfly keeps the
        // order fixed (the same sum, in the same order, as DhEpilogue's for these columns).
        part += __shfl_xor_sync(0xffffffffu, part, 1);
        part += __shfl_xor_sync(0xffffffffu, part, 2);
        const int col = kPartials * n_tile + half;
        if (row_ok && col < p.ds_cols && (threadIdx.x & 3) == 0)
          p.ds_partials[int64_t(slot) * p.ds_cols + col] = part;
      }
    }
  }
};

// up_proj on the warp-specialised kernel with schedule Sched; same contract as up_proj.
template <class Sched>
void up_proj_gather(const RoutingPlanView& plan, const bf16* x, const bf16* w1, bf16* h, bf16* a,
                    int64_t d, int64_t n, Activation act, cudaStream_t stream) {
  constexpr int kTileN = Sched::kTileN;
  const bool gated = is_gated(act);
  Args p = gather_args(plan, x, d);  // x (T, d), rows gathered per slot
  p.n_tiles = static_cast<int>(gated ? (n + kTileN / 2 - 1) / (kTileN / 2)
                                     : (n + kTileN - 1) / kTileN);
  p.b_rows_per_expert = static_cast<int>(gated ? 2 * n : n);  // w1 (E, w1_rows, d): K-major
  p.b_cols = static_cast<int>(d);
  p.gate_split = gated ? static_cast<int>(n) : 0;
  ActParams ep{reinterpret_cast<__nv_bfloat16*>(h), reinterpret_cast<__nv_bfloat16*>(a),
               static_cast<int>(n), act};
  launch_gather_gemm<GMajor::K, GatherActEpilogue<typename Sched::Frag>, Sched>(p, w1, ep,
                                                                                plan.S, stream);
}

// dh_proj on the warp-specialised kernel with schedule Sched; same contract as dh_proj.
template <class Sched>
void dh_proj_gather(const RoutingPlanView& plan, const bf16* d_out, const bf16* w2, const bf16* h,
                    float* ds_partials, bf16* dh, bf16* a_scaled, int64_t d, int64_t n,
                    Activation act, cudaStream_t stream) {
  Args p = gather_args(plan, d_out, d);  // d_out (T, d), rows gathered per slot
  p.n_tiles = static_cast<int>((n + Sched::kTileN - 1) / Sched::kTileN);
  p.b_rows_per_expert = static_cast<int>(d);  // w2 (E, d, n): K = d rows of N = n columns
  p.b_cols = static_cast<int>(n);
  p.gate_split = 0;
  const DhParams ep = make_dh_params(plan, h, ds_partials, dh, a_scaled, n, act);
  launch_gather_gemm<GMajor::MN, GatherDhEpilogue<typename Sched::Frag>, Sched>(p, w2, ep,
                                                                                plan.S, stream);
}

}  // namespace moeblaze::cuda::gemm::sm90::ws
