// The plain bf16 store of the contiguous-A GEMMs on the warp-specialised kernel (down_proj:
// y = a · w2_eᵀ; dx_proj: dX̃ = dh · w1_e): out[slot, j] = acc, nothing else. The columns go as
// in act_epilogue.cuh without the activation: a quad's lanes pack their fragment's words of four
// column groups, a quad transpose (quad_transpose.cuh) gives each lane one whole group, stored
// with one 16-byte store (two full 32-byte sectors per row and quad).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "cuda/gemm/epilogues/quad_transpose.cuh"
#include "cuda/gemm/pipeline/sm90_gemm_core.cuh"  // pack_bf16x2

namespace moeblaze::cuda::gemm::sm90 {

struct StoreParams {
  __nv_bfloat16* out;  // (S, N) bf16, rows indexed by slot
  int N;               // output columns, a multiple of 8 (the CUDA backend takes d % 64 == 0)
};

// Rows past the expert's end and columns past N store nothing; every lane runs the shuffles.
template <class Frag, class Acc>
__device__ __forceinline__ void store_epilogue(const StoreParams& p, Acc& acc, int m_begin,
                                               int m_end, int n_tile) {
  static_assert(Frag::kGroups % 4 == 0, "column groups come in quads");
  const int q = threadIdx.x & 3;
  const int n0 = n_tile * Frag::kTileN;
#pragma unroll
  for (int r = 0; r < Frag::kRows; ++r) {
    const int slot = m_begin + Frag::row(r);
    const bool row_ok = slot < m_end;
    __nv_bfloat16* out_row = p.out + (row_ok ? int64_t(slot) : 0) * p.N;
#pragma unroll
    for (int i0 = 0; i0 < Frag::kGroups; i0 += 4) {
      uint32_t w[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const int idx = Frag::acc_index(r, i0 + k);
        w[k] = pack_bf16x2(acc(idx), acc(idx + 1));
      }
      quad_transpose(w);
      const int jv = n0 + 8 * (i0 + q);  // this lane's group after the transpose
      if (row_ok && jv < p.N)
        *reinterpret_cast<uint4*>(out_row + jv) = make_uint4(w[0], w[1], w[2], w[3]);
    }
  }
}

}  // namespace moeblaze::cuda::gemm::sm90
