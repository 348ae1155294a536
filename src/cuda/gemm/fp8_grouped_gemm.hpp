// FP8 grouped GEMMs on e4m3 operands with DeepSeek-V3's fine-grained scales (docs/FP8.md): the
// contract of the GEMM folder's FP8 entry points. Internal to the CUDA backend; the FP8 layer
// (src/cuda/layer/layer_fp8.cu) runs its four data GEMMs on contiguous(); varlen_k() is the
// weight gradients' GEMM (K = each expert's tokens).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "cuda/gemm/dispatch/kernel_config.hpp"  // Fp8Kernel
#include "cuda/gemm/grouped_gemm.hpp"              // ExpertRows
#include "moeblaze/dtype.hpp"

namespace moeblaze::cuda::gemm::fp8 {

// Both entry points take the kernel as a value (Fp8Kernel, dispatch/kernel_config.hpp: the
// layer runs choose_fp8_kernel(); bench gemm times each built one):
//   cooperative, cluster 1  128 x 128 tiles, both consumer warpgroups on one tile;
//   cooperative, cluster 2  the same on CTA pairs along N sharing A's tiles by TMA multicast;
//   ping_pong, cluster 1    64 x 128 tiles, one per warpgroup, one's epilogue under the
//                           other's mainloop. Any other combination is refused (Unsupported).

// The checks both entry points share: every operand given and 16-byte aligned (TMA), a kernel
// built for FP8; throws InvalidArgument / Unsupported naming the argument.
void check_fp8_operands(const uint8_t* qa, const float* sa, const uint8_t* qb, const float* sb,
                        const bf16* d, const void* scratch, const Fp8Kernel& kernel);

// Scratch bytes of contiguous() for E experts on the current device (argument arrays and
// CUTLASS's per-SM TMA descriptors), enough for every built kernel.
size_t contiguous_scratch_bytes(int64_t E);

// For every expert e and i < rows.end[e] - rows.begin[e] (row r = rows.begin[e] + i):
//   d[rows.out[e] + i, n] = Σ_kb sa[r, kb] · sb[e, n / 128, kb] · Σ_{k in kb} qa[r, k] · qb[e, n, k]
// with fp32 sums, the tensor cores' partial sums promoted every 128 of K.
//   qa (rows, K) e4m3 codes, sa (rows, K / 128) fp32: cuda/fp8/quantize.hpp's 1x128 tiles;
//   qb (E, N, K) codes, sb (E, N / 128, K / 128): its 128x128 blocks; d (rows, N) bf16.
// The down-projection's shape (a = the activation, b = W2): B is read K-major, as FP8 WGMMA
// needs. N and K must be multiples of 128, E >= 1, pointers 16-byte aligned (Unsupported /
// InvalidArgument naming the argument, nothing enqueued). No host sync; stream-ordered.
void contiguous(ExpertRows rows, int64_t E, const uint8_t* qa, const float* sa, const uint8_t* qb,
                const float* sb, bf16* d, int64_t N, int64_t K, void* scratch,
                size_t scratch_bytes, cudaStream_t stream, const Fp8Kernel& kernel = kFp8Default);

// Scratch bytes of varlen_k() for E experts on the current device (argument arrays and
// CUTLASS's per-SM TMA descriptors), enough for every built kernel.
size_t varlen_k_scratch_bytes(int64_t E);

// The weight-gradient shape: for every expert e, with P_e = poff[e+1] - poff[e] (a positive
// multiple of 128, read on the device only):
//   d[e*M*N + m*N + n] = Σ_kb sa_e[m, kb] · sb_e[n, kb] · Σ_{k in kb} qa_e[m, k] · qb_e[n, k]
//   qa_e = qa + M*poff[e]: (M, P_e) e4m3 codes, K contiguous;
//   sa_e = sa + M*poff[e]/128: (M, P_e/128) fp32, K-major;
//   qb_e = qb + N*poff[e]: (N, P_e) codes; sb_e = sb + N*poff[e]/128: (N, P_e/128);
//   d: (E, M, N) bf16 row-major (dW1 (E, w1_rows, d) with M = w1_rows, N = d; dW2 (E, d, n)).
// fp32 sums, the tensor cores' partial sums promoted every 128 of K. M and N multiples of 128
// (Unsupported naming them), E >= 1, pointers 16-byte aligned; the operands come from
// cuda/fp8/quantize_tokens.hpp (which pads empty experts to one zero group, since a K = 0 tile
// would leave its accumulators unset). No host sync; stream-ordered.
void varlen_k(const int32_t* poff, int64_t E, int64_t M, int64_t N, const uint8_t* qa,
              const float* sa, const uint8_t* qb, const float* sb, bf16* d, void* scratch,
              size_t scratch_bytes, cudaStream_t stream, const Fp8Kernel& kernel = kFp8Default);

// The instantiation files' entry points, one per built kernel other than cooperative on single
// CTAs (instantiations/fp8_*_c2.cu): the same arguments as contiguous() / varlen_k() after their
// checks.
namespace detail {
size_t contiguous_c2_scratch_bytes(int E);
void contiguous_c2(ExpertRows rows, int E, const uint8_t* qa, const float* sa, const uint8_t* qb,
                   const float* sb, bf16* d, int N, int K, void* scratch, size_t scratch_bytes,
                   cudaStream_t stream);
size_t varlen_k_c2_scratch_bytes(int E);
void varlen_k_c2(const int32_t* poff, int E, int M, int N, const uint8_t* qa, const float* sa,
                 const uint8_t* qb, const float* sb, bf16* d, void* scratch, size_t scratch_bytes,
                 cudaStream_t stream);
}  // namespace detail

}  // namespace moeblaze::cuda::gemm::fp8
