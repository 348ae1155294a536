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

#include <cstdint>

#include "cuda/activation.cuh"
#include "cuda/gemm/epilogues/quad_transpose.cuh"
#include "cuda/gemm/pipeline/sm90_gemm_core.cuh"

namespace moeblaze::cuda::gemm::sm90 {

// h (S, w1_rows) and a (S, n), both bf16; either may be null. b1 (E, w1_rows) bf16 or null: the
// expert biases, added to the fp32 accumulators before h is rounded and a computed.
struct ActParams {
  __nv_bfloat16* h;
  __nv_bfloat16* a;
  int n;
  Activation act;
  const __nv_bfloat16* b1 = nullptr;
};

// acc(i), acc(i + 1) += b[0], b[1] (bias row b at an even column, so one 4-byte load).
template <class Acc>
__device__ __forceinline__ void add_bias_pair(Acc& acc, int i, const __nv_bfloat16* b) {
  const float2 v = __bfloat1622float2(__ldg(reinterpret_cast<const __nv_bfloat162*>(b)));
  acc(i) += v.x;
  acc(i + 1) += v.y;
}

// Column groups go in quads: the quad's lanes compute their fragment's words of four groups,
// a quad transpose (quad_transpose.cuh) gives each lane one whole group (16 bytes), stored with
// one vector store per lane and array: two full 32-byte sectors per row and quad instead of four
// half-written ones. Rows past the expert's end and columns past n store nothing (the shuffles
// need every lane, so nothing is skipped before them). expert: the tile's expert (b1's row).
template <Activation A, class Frag, class Acc>
__device__ __forceinline__ void act_epilogue_body(const ActParams& p, Acc& acc, int m_begin,
                                                  int m_end, int n_tile, int expert) {
  constexpr bool kGated = dev_is_gated(A);
  static_assert(Frag::kGroups % (kGated ? 8 : 4) == 0, "column groups come in quads");
  const int64_t w1_rows = kGated ? 2 * int64_t(p.n) : p.n;
  const int q = threadIdx.x & 3;
  // The bias joins the accumulators once, before any row is packed (columns past n: none).
  if (p.b1 != nullptr) {
    const __nv_bfloat16* b1_e = p.b1 + int64_t(expert) * w1_rows;
#pragma unroll
    for (int i = 0; i < (kGated ? Frag::kGroups / 2 : Frag::kGroups); ++i) {
      const int j = n_tile * (kGated ? Frag::kTileN / 2 : Frag::kTileN) + Frag::col(i);
      if (j >= p.n) continue;
#pragma unroll
      for (int r = 0; r < Frag::kRows; ++r) {
        add_bias_pair(acc, Frag::acc_index(r, i), b1_e + j);
        if constexpr (kGated)
          add_bias_pair(acc, Frag::acc_index(r, i + Frag::kGroups / 2), b1_e + p.n + j);
      }
    }
  }
#pragma unroll
  for (int r = 0; r < Frag::kRows; ++r) {
    const int slot = m_begin + Frag::row(r);
    const bool row_ok = slot < m_end;
    const int64_t row = row_ok ? slot : 0;
    __nv_bfloat16* h_row = p.h ? p.h + row * w1_rows : nullptr;
    __nv_bfloat16* a_row = p.a ? p.a + row * p.n : nullptr;
    if constexpr (kGated) {
      constexpr int kHalf = Frag::kGroups / 2;
      const int j0 = n_tile * (Frag::kTileN / 2);
#pragma unroll
      for (int i0 = 0; i0 < kHalf; i0 += 4) {
        uint32_t hg[4], hu[4], av[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const int gi = Frag::acc_index(r, i0 + k), ui = Frag::acc_index(r, i0 + k + kHalf);
          const float g0 = acc(gi), g1 = acc(gi + 1);
          const float u0 = acc(ui), u1 = acc(ui + 1);
          hg[k] = pack_bf16x2(g0, g1);
          hu[k] = pack_bf16x2(u0, u1);
          av[k] = pack_bf16x2(dev_act_fast(A, g0) * dev_up(A, u0),
                              dev_act_fast(A, g1) * dev_up(A, u1));
        }
        const int jv = j0 + 8 * (i0 + q);  // this lane's group after the transpose
        const bool ok = row_ok && jv < p.n;  // n is a multiple of 64: groups never straddle it
        if (h_row) {
          quad_transpose(hg);
          quad_transpose(hu);
          if (ok) {
            *reinterpret_cast<uint4*>(h_row + jv) = make_uint4(hg[0], hg[1], hg[2], hg[3]);
            *reinterpret_cast<uint4*>(h_row + p.n + jv) = make_uint4(hu[0], hu[1], hu[2], hu[3]);
          }
        }
        if (a_row) {
          quad_transpose(av);
          if (ok) *reinterpret_cast<uint4*>(a_row + jv) = make_uint4(av[0], av[1], av[2], av[3]);
        }
      }
    } else {
      const int n0 = n_tile * Frag::kTileN;
#pragma unroll
      for (int i0 = 0; i0 < Frag::kGroups; i0 += 4) {
        uint32_t hv[4], av[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const int hi = Frag::acc_index(r, i0 + k);
          const float h0 = acc(hi), h1 = acc(hi + 1);
          hv[k] = pack_bf16x2(h0, h1);
          av[k] = pack_bf16x2(dev_act_fast(A, h0), dev_act_fast(A, h1));
        }
        const int jv = n0 + 8 * (i0 + q);
        const bool ok = row_ok && jv < p.n;
        if (h_row) {
          quad_transpose(hv);
          if (ok) *reinterpret_cast<uint4*>(h_row + jv) = make_uint4(hv[0], hv[1], hv[2], hv[3]);
        }
        if (a_row) {
          quad_transpose(av);
          if (ok) *reinterpret_cast<uint4*>(a_row + jv) = make_uint4(av[0], av[1], av[2], av[3]);
        }
      }
    }
  }
}

// One straight-line body per activation: the switch runs once per tile, not per element.
template <class Frag, class Acc>
__device__ __forceinline__ void act_epilogue(const ActParams& p, Acc& acc, int m_begin,
                                             int m_end, int n_tile, int expert) {
  dispatch_activation(p.act, [&](auto a) {
    act_epilogue_body<decltype(a)::value, Frag>(p, acc, m_begin, m_end, n_tile, expert);
  });
}

}  // namespace moeblaze::cuda::gemm::sm90
