// The up-projection's epilogue, shared by its two kernels (up_proj.cu: 2-CTA, 128 x 128 tiles;
// up_proj_ws.cu: warp-specialised, 128 x 256 cooperative or 128 x 128 ping-pong tiles): h and the activation output a from the
// fp32 accumulators. The kernels differ only in where a thread's accumulators sit, which the
// fragment policy Frag says:
//   Frag::kTileN          output columns of a tile (gated: gate columns j, then the same j's up)
//   Frag::kGroups         column groups per thread (columns col(i) and col(i) + 1 of group i)
//   Frag::kRows           rows per thread
//   Frag::row(r)          tile row of the thread's row r
//   Frag::col(i)          tile column of group i
//   Frag::acc_index(r, i) where (row r, column col(i) + v0) sits: acc(acc_index(r, i) + v0)
// For gated activations tile n_tile covers j in [n_tile * kTileN / 2, ...), gate in groups
// [0, kGroups / 2) and up in [kGroups / 2, kGroups): g and u of one j are in the same thread.
#pragma once

#include <cuda_bf16.h>

#include "cuda/activation.cuh"
#include "cuda/gemm/sm90_gemm_core.cuh"  // store_bf16x2

namespace moeblaze::cuda::gemm::sm90 {

// h (S, w1_rows) and a (S, n), both bf16; either may be null.
struct ActParams {
  __nv_bfloat16* h;
  __nv_bfloat16* a;
  int n;
  Activation act;
};

template <Activation A, class Frag, class Acc>
__device__ __forceinline__ void act_epilogue_body(const ActParams& p, Acc& acc, int m_begin,
                                                  int m_end, int n_tile) {
  constexpr bool kGated = A == Activation::swiglu || A == Activation::geglu;
  const int64_t w1_rows = kGated ? 2 * int64_t(p.n) : p.n;
#pragma unroll
  for (int r = 0; r < Frag::kRows; ++r) {
    const int slot = m_begin + Frag::row(r);
    if (slot >= m_end) continue;
    __nv_bfloat16* h_row = p.h ? p.h + int64_t(slot) * w1_rows : nullptr;
    __nv_bfloat16* a_row = p.a ? p.a + int64_t(slot) * p.n : nullptr;
    if constexpr (kGated) {
      constexpr int kHalf = Frag::kGroups / 2;
      const int j0 = n_tile * (Frag::kTileN / 2);
#pragma unroll
      for (int i = 0; i < kHalf; ++i) {
        const int j = j0 + Frag::col(i);
        if (j >= p.n) continue;  // the last tile when n is not a multiple of kTileN / 2
        const int gi = Frag::acc_index(r, i), ui = Frag::acc_index(r, i + kHalf);
        const float g0 = acc(gi), g1 = acc(gi + 1);
        const float u0 = acc(ui), u1 = acc(ui + 1);
        if (h_row) {
          store_bf16x2(h_row + j, g0, g1);
          store_bf16x2(h_row + p.n + j, u0, u1);
        }
        if (a_row) store_bf16x2(a_row + j, dev_act(A, g0) * u0, dev_act(A, g1) * u1);
      }
    } else {
      const int n0 = n_tile * Frag::kTileN;
#pragma unroll
      for (int i = 0; i < Frag::kGroups; ++i) {
        const int j = n0 + Frag::col(i);
        if (j >= p.n) continue;
        const int hi = Frag::acc_index(r, i);
        const float h0 = acc(hi), h1 = acc(hi + 1);
        if (h_row) store_bf16x2(h_row + j, h0, h1);
        if (a_row) store_bf16x2(a_row + j, dev_act(A, h0), dev_act(A, h1));
      }
    }
  }
}

// One straight-line body per activation: the switch runs once per tile, not per element.
template <class Frag, class Acc>
__device__ __forceinline__ void act_epilogue(const ActParams& p, Acc& acc, int m_begin,
                                             int m_end, int n_tile) {
  dispatch_activation(p.act, [&](auto a) {
    act_epilogue_body<decltype(a)::value, Frag>(p, acc, m_begin, m_end, n_tile);
  });
}

}  // namespace moeblaze::cuda::gemm::sm90
