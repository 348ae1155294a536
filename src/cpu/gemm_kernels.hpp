// Small single-threaded GEMM kernels for the CPU backend: fp32 accumulation over bf16 or fp32
// storage, optional row gather on either operand, packed panels and a register-blocked
// micro-kernel. Callers parallelise over independent output tiles.
//
// Every output element is the plain sequential fp32 sum over k = 0, 1, ..., K-1 (k-blocks in
// ascending order, and the partial sum is stored and reloaded in fp32, which rounds exactly as
// a register would). So a result depends only on its own row and column data, never on how
// M, N or K were blocked, on the tile an element sits in, or on the thread that computed it:
// this is what makes CPU results bitwise independent of the thread count and of tile sizes,
// and what makes H recomputed in backward bit-identical to H computed in forward.
//
// Operands are described by MatRef: element (r, c) of the storage is
//   data[(rows ? rows[r] : r) * ld + c]
// i.e. row-major storage whose rows may be gathered through an index list (the routing plan's
// expert_token_indices), so no gathered copy of X or dO is ever made.
//
//   gemm_nt  C (M,N) = A (M,K) · B (N,K)ᵀ   A rows = M, B rows = N  (x · W1ᵀ, a · W2ᵀ)
//   gemm_nn  C (M,N) = A (M,K) · B (K,N)    A rows = M, B rows = K  (dO · W2, dH · W1)
//   gemm_tn  C (M,N) = A (K,M)ᵀ · B (K,N)   A rows = K, B rows = K  (dOᵀ · A', dHᵀ · X)
// With `accumulate`, C += instead of C = (the sum continues from C's value in order).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "moeblaze/dtype.hpp"

namespace moeblaze::cpu::gemm {

struct MatRef {
  const void* data = nullptr;
  DType dtype = DType::f32;  // f32 or bf16
  int64_t ld = 0;            // elements between consecutive storage rows
  const int32_t* rows = nullptr;  // optional gather: storage row r is rows[r]

  const void* row_ptr(int64_t r) const {
    const int64_t rr = rows ? rows[r] : r;
    return static_cast<const char*>(data) + rr * ld * static_cast<int64_t>(dtype_size(dtype));
  }
};

inline MatRef mat(const void* data, DType dtype, int64_t ld, const int32_t* rows = nullptr) {
  MatRef m;
  m.data = data;
  m.dtype = dtype;
  m.ld = ld;
  m.rows = rows;
  return m;
}

// Register tile of the micro-kernel (MR x NR fp32 accumulators: 4 x 8 = 8 SSE registers; 4 x 8
// measured fastest of 4..8 x 8..16 with -march=x86-64-v2, ~20 GFLOP/s per core)
// and cache blocks: a packed A block (MC x KC) stays in L1/L2, a packed B block (KC x NC) in L2.
constexpr int64_t kMR = 4;
constexpr int64_t kNR = 8;
constexpr int64_t kMC = 128;
constexpr int64_t kKC = 256;
constexpr int64_t kNC = 256;

static_assert(kMC % kMR == 0 && kNC % kNR == 0, "cache blocks hold whole register tiles");

// Floats of packing scratch one gemm_* call needs (for any M, N, K up to the block sizes).
constexpr int64_t kPackFloats = kMC * kKC + kKC * kNC;

namespace detail {

inline float load_elem(const float* p, int64_t i) { return p[i]; }
inline float load_elem(const uint16_t* p, int64_t i) {
  return bf16::to_float(p[i]);
}

// dst[p][k][w] = storage(r0 + p*W + w, c0 + k): the panel index runs over storage rows, so this
// is a transposing pack (operand whose reduction dim is contiguous in memory). Zero-padded.
template <int64_t W, typename S>
inline void pack_transposed(const MatRef& m, int64_t r0, int64_t rcount, int64_t c0,
                            int64_t kc, float* dst) {
  for (int64_t p0 = 0; p0 < rcount; p0 += W) {
    const int64_t w_count = std::min(W, rcount - p0);
    float* panel = dst + (p0 / W) * kc * W;
    for (int64_t w = 0; w < w_count; ++w) {
      const S* src = static_cast<const S*>(m.row_ptr(r0 + p0 + w)) + c0;
      for (int64_t k = 0; k < kc; ++k) panel[k * W + w] = load_elem(src, k);
    }
    for (int64_t w = w_count; w < W; ++w)
      for (int64_t k = 0; k < kc; ++k) panel[k * W + w] = 0.0f;
  }
}

// dst[p][k][w] = storage(k0 + k, c0 + p*W + w): storage rows are the reduction dim, the panel
// dim is contiguous in memory (a straight copy with conversion). Zero-padded.
template <int64_t W, typename S>
inline void pack_direct(const MatRef& m, int64_t k0, int64_t kc, int64_t c0, int64_t ccount,
                        float* dst) {
  const int64_t panels = (ccount + W - 1) / W;
  for (int64_t k = 0; k < kc; ++k) {
    const S* src = static_cast<const S*>(m.row_ptr(k0 + k)) + c0;
    for (int64_t p = 0; p < panels; ++p) {
      float* out = dst + p * kc * W + k * W;
      const int64_t base = p * W;
      if (base + W <= ccount) {
        for (int64_t w = 0; w < W; ++w) out[w] = load_elem(src, base + w);
      } else {
        for (int64_t w = 0; w < W; ++w) out[w] = base + w < ccount ? load_elem(src, base + w) : 0.0f;
      }
    }
  }
}

template <int64_t W>
inline void pack_transposed_any(const MatRef& m, int64_t r0, int64_t rcount, int64_t c0,
                                int64_t kc, float* dst) {
  if (m.dtype == DType::bf16)
    pack_transposed<W, uint16_t>(m, r0, rcount, c0, kc, dst);
  else
    pack_transposed<W, float>(m, r0, rcount, c0, kc, dst);
}
template <int64_t W>
inline void pack_direct_any(const MatRef& m, int64_t k0, int64_t kc, int64_t c0, int64_t ccount,
                            float* dst) {
  if (m.dtype == DType::bf16)
    pack_direct<W, uint16_t>(m, k0, kc, c0, ccount, dst);
  else
    pack_direct<W, float>(m, k0, kc, c0, ccount, dst);
}

// C[0:mr, 0:nr] (+)= Σ_k a[k][0:MR] b[k][0:NR], sequential in k. Full tiles keep all MR x NR
// sums in registers (the constant-bound loops are unrolled and vectorised over NR).
inline void micro_kernel(int64_t kc, const float* __restrict a, const float* __restrict b,
                         float* __restrict c, int64_t ldc, bool load_c, int64_t mr, int64_t nr) {
  float acc[kMR][kNR];
  if (load_c && mr == kMR && nr == kNR) {
    for (int64_t i = 0; i < kMR; ++i)
      for (int64_t j = 0; j < kNR; ++j) acc[i][j] = c[i * ldc + j];
  } else {
    for (int64_t i = 0; i < kMR; ++i)
      for (int64_t j = 0; j < kNR; ++j) acc[i][j] = (load_c && i < mr && j < nr) ? c[i * ldc + j] : 0.0f;
  }
  for (int64_t k = 0; k < kc; ++k) {
    const float* ak = a + k * kMR;
    const float* bk = b + k * kNR;
    for (int64_t i = 0; i < kMR; ++i) {
      const float ai = ak[i];
      for (int64_t j = 0; j < kNR; ++j) acc[i][j] += ai * bk[j];
    }
  }
  if (mr == kMR && nr == kNR) {
    for (int64_t i = 0; i < kMR; ++i)
      for (int64_t j = 0; j < kNR; ++j) c[i * ldc + j] = acc[i][j];
  } else {
    for (int64_t i = 0; i < mr; ++i)
      for (int64_t j = 0; j < nr; ++j) c[i * ldc + j] = acc[i][j];
  }
}

enum class Form { nt, nn, tn };

// The one blocked driver; the three public forms differ only in how A and B are packed.
template <Form F>
inline void gemm(int64_t M, int64_t N, int64_t K, const MatRef& A, const MatRef& B, float* C,
                 int64_t ldc, bool accumulate, float* pack) {
  if (M <= 0 || N <= 0) return;
  if (K <= 0) {
    if (!accumulate)
      for (int64_t i = 0; i < M; ++i) std::memset(C + i * ldc, 0, sizeof(float) * N);
    return;
  }
  float* apack = pack;               // (MC/MR panels) x KC x MR
  float* bpack = pack + kMC * kKC;   // (NC/NR panels) x KC x NR
  for (int64_t jc = 0; jc < N; jc += kNC) {
    const int64_t nc = std::min(kNC, N - jc);
    for (int64_t pc = 0; pc < K; pc += kKC) {
      const int64_t kc = std::min(kKC, K - pc);
      const bool load_c = accumulate || pc > 0;
      if (F == Form::nt)
        pack_transposed_any<kNR>(B, jc, nc, pc, kc, bpack);
      else
        pack_direct_any<kNR>(B, pc, kc, jc, nc, bpack);
      for (int64_t ic = 0; ic < M; ic += kMC) {
        const int64_t mc = std::min(kMC, M - ic);
        if (F == Form::tn)
          pack_direct_any<kMR>(A, pc, kc, ic, mc, apack);
        else
          pack_transposed_any<kMR>(A, ic, mc, pc, kc, apack);
        for (int64_t jr = 0; jr < nc; jr += kNR) {
          const float* bp = bpack + (jr / kNR) * kc * kNR;
          for (int64_t ir = 0; ir < mc; ir += kMR) {
            micro_kernel(kc, apack + (ir / kMR) * kc * kMR, bp,
                         C + (ic + ir) * ldc + jc + jr, ldc, load_c, std::min(kMR, mc - ir),
                         std::min(kNR, nc - jr));
          }
        }
      }
    }
  }
}

}  // namespace detail

// `pack` is caller scratch of kPackFloats floats (one per thread).
inline void gemm_nt(int64_t M, int64_t N, int64_t K, const MatRef& A, const MatRef& B, float* C,
                    int64_t ldc, bool accumulate, float* pack) {
  detail::gemm<detail::Form::nt>(M, N, K, A, B, C, ldc, accumulate, pack);
}
inline void gemm_nn(int64_t M, int64_t N, int64_t K, const MatRef& A, const MatRef& B, float* C,
                    int64_t ldc, bool accumulate, float* pack) {
  detail::gemm<detail::Form::nn>(M, N, K, A, B, C, ldc, accumulate, pack);
}
inline void gemm_tn(int64_t M, int64_t N, int64_t K, const MatRef& A, const MatRef& B, float* C,
                    int64_t ldc, bool accumulate, float* pack) {
  detail::gemm<detail::Form::tn>(M, N, K, A, B, C, ldc, accumulate, pack);
}

// Stores an fp32 row into bf16 or fp32 storage (round to nearest even for bf16).
inline void store_row(const float* src, int64_t count, void* dst, DType dtype) {
  if (dtype == DType::bf16) {
    uint16_t* d = static_cast<uint16_t*>(dst);
    for (int64_t i = 0; i < count; ++i) d[i] = bf16::from_float(src[i]);
  } else {
    std::memcpy(dst, src, sizeof(float) * count);
  }
}
// Loads a bf16 or fp32 row into fp32.
inline void load_row(const void* src, DType dtype, int64_t count, float* dst) {
  if (dtype == DType::bf16) {
    const uint16_t* s = static_cast<const uint16_t*>(src);
    for (int64_t i = 0; i < count; ++i) dst[i] = bf16::to_float(s[i]);
  } else {
    std::memcpy(dst, src, sizeof(float) * count);
  }
}

}  // namespace moeblaze::cpu::gemm
