// (5) dW2 and (8) dW1 — varlen-K grouped GEMM: for every expert e the reduction runs over its
// slots [off[e], off[e+1]) read on the device,
//   out[e] (M x N) = sum over slots r of e of P[rowP(r), :]ᵀ ⊗ Q[rowQ(r), :]
// with rowX(r) = token (gathered through expert_token_indices) or r itself. Both operands are
// read MN-major: one slot is one K row of 128 contiguous M (or N) elements, so the gather and the
// expert's unaligned K range cost nothing extra (rows beyond the range are zero-filled).
// Grid (M/128 * N/128, E): every CTA owns one output tile of one expert (tiles walked in
// raster_tile's order within the expert); an expert with no slot stores zeros. One
// instantiation: varlen_k_kernel (both GEMMs differ only in their arguments). This is the 2-CTA
// kernel (GatherKernel::two_cta); the warp-specialised one, the default, is in dw2_proj_ws.cu /
// dw1_proj_ws.cu (sm90_ws_varlen_k.cuh).
#include <climits>

#include "cuda/cuda_backend.hpp"
#include "cuda/gemm/dispatch/gemm_checks.hpp"
#include "cuda/gemm/grouped_gemm.hpp"
#include "cuda/gemm/dispatch/raster.hpp"
#include "cuda/gemm/pipeline/sm90_gemm_core.cuh"
#include "cuda/gemm/dispatch/ws_paths.hpp"
#include "moeblaze/error.hpp"

namespace moeblaze::cuda::gemm {
namespace sm90 {

struct VarlenKArgs {
  const __nv_bfloat16* p;  // (rows, M) first operand
  const int32_t* p_gather;  // (S,) slot -> row of p, or nullptr
  const __nv_bfloat16* q;  // (rows, N) second operand
  const int32_t* q_gather;
  const int32_t* offsets;  // (E+1,)
  int M, N;
  int n_tiles;
  __nv_bfloat16* out;  // (E, M, N)
  // Set by launch_varlen_k: ceil(M / kBM) and the band height of raster_tile (1..m_tiles).
  int m_tiles;
  int raster_group;
};

__global__ void __launch_bounds__(kThreads, kMinBlocks) varlen_k_kernel(const VarlenKArgs a) {
  using Cfg = TileConfig<GMajor::MN, GMajor::MN>;
  extern __shared__ char smem_raw[];
  char* smem = align_smem_1k(smem_raw);
  const int expert = blockIdx.y;
  int m_tile, n_tile;
  raster_tile(static_cast<int>(blockIdx.x), a.m_tiles, a.n_tiles, a.raster_group, m_tile, n_tile);
  const int k_begin = a.offsets[expert], k_end = a.offsets[expert + 1];
  const int tid = threadIdx.x;

  MNMajorLoader lp, lq;
  lp.init(tid, a.p, a.M, a.p_gather, k_begin, k_end, m_tile * kBM, a.M);
  lq.init(tid, a.q, a.N, a.q_gather, k_begin, k_end, n_tile * kBN, a.N);
  auto acc = cute::partition_fragment_C(typename Cfg::TiledMma{},
                                        cute::Shape<cute::Int<kBM>, cute::Int<kBN>>{});
  mainloop<Cfg, 1>(smem, lp, lq, (k_end - k_begin + kBK - 1) / kBK, acc);

  __nv_bfloat16* out = a.out + int64_t(expert) * a.M * a.N;
  const int m0 = m_tile * kBM, n0 = n_tile * kBN;
#pragma unroll
  for (int v1 = 0; v1 < 2; ++v1) {
    const int m = m0 + frag_row(v1);
    if (m >= a.M) continue;
    __nv_bfloat16* out_row = out + int64_t(m) * a.N + n0;
#pragma unroll
    for (int i = 0; i < kFragColGroups; ++i) {
      const int c = frag_col(i);
      if (n0 + c < a.N) store_bf16x2(out_row + c, acc(4 * i + 2 * v1), acc(4 * i + 2 * v1 + 1));
    }
  }
}

void launch_varlen_k(const VarlenKArgs& a, int64_t E, cudaStream_t stream) {
  using Cfg = TileConfig<GMajor::MN, GMajor::MN>;
  const int64_t m_tiles = (a.M + kBM - 1) / kBM;
  const int64_t tiles = m_tiles * a.n_tiles;
  MOEBLAZE_UNSUPPORTED_IF(tiles > int64_t(INT32_MAX), "weight-gradient GEMM of ", tiles,
                          " tiles per expert exceeds 2^31 - 1");
  MOEBLAZE_UNSUPPORTED_IF(E > 65535, "weight-gradient GEMM: E (", E,
                          ") must be at most 65535 for the CUDA backend");
  MOEBLAZE_CUDA_CHECK(cudaFuncSetAttribute(
      varlen_k_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes));
  VarlenKArgs q = a;
  q.m_tiles = static_cast<int>(m_tiles);
  q.raster_group = clamp_raster_group(raster_group(), m_tiles);
  const dim3 grid(static_cast<unsigned>(tiles), static_cast<unsigned>(E));
  varlen_k_kernel<<<grid, kThreads, Cfg::kSmemBytes, stream>>>(q);
  MOEBLAZE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace sm90

void dw2_proj(const RoutingPlanView& plan, const bf16* d_out, const bf16* a_scaled, bf16* dw2,
              int64_t d, int64_t n, cudaStream_t stream, GatherKernel kernel,
              const LayerKernels* kernels) {
  constexpr const char* fn = "dw2_proj";
  detail::check_plan(fn, plan, /*gathers=*/true, /*weights=*/false);
  detail::check_dims(fn, d, n);
  detail::check_ptr(fn, d_out, "d_out", plan.S > 0);
  detail::check_ptr(fn, a_scaled, "a_scaled", plan.S > 0);
  detail::check_ptr(fn, dw2, "dw2");
  const GemmKernel chosen = (kernels ? *kernels : choose_kernels({plan.S, plan.E, d, n})).dw2;
  // Any E: this kernel has no per-CTA expert table.
  if (kernel == GatherKernel::ping_pong || kernel == GatherKernel::warp_specialized ||
      (kernel == GatherKernel::automatic && chosen.family == KernelFamily::ws_varlen_k)) {
    MOEBLAZE_UNSUPPORTED_IF(kernel == GatherKernel::ping_pong, fn,
                            ": GatherKernel::ping_pong is implemented for up_proj and dh_proj only");
    detail::dw2_proj_ws(plan, d_out, a_scaled, dw2, d, n, chosen.store_by_tma, stream);
    return;
  }
  sm90::VarlenKArgs a{};
  a.p = reinterpret_cast<const __nv_bfloat16*>(d_out);  // (T, d): M = d, rows gathered
  a.p_gather = plan.expert_token_indices;
  a.q = reinterpret_cast<const __nv_bfloat16*>(a_scaled);  // (S, n): N = n
  a.q_gather = nullptr;
  a.offsets = plan.expert_token_offsets;
  a.M = static_cast<int>(d);
  a.N = static_cast<int>(n);
  a.n_tiles = static_cast<int>((n + sm90::kBN - 1) / sm90::kBN);
  a.out = reinterpret_cast<__nv_bfloat16*>(dw2);  // (E, d, n)
  sm90::launch_varlen_k(a, plan.E, stream);
}

void dw1_proj(const RoutingPlanView& plan, const bf16* dh, const bf16* x, bf16* dw1, int64_t d,
              int64_t n, Activation act, cudaStream_t stream, GatherKernel kernel,
              const LayerKernels* kernels) {
  constexpr const char* fn = "dw1_proj";
  detail::check_plan(fn, plan, /*gathers=*/true, /*weights=*/false);
  detail::check_dims(fn, d, n);
  detail::check_ptr(fn, dh, "dh", plan.S > 0);
  detail::check_ptr(fn, x, "x", plan.S > 0);
  detail::check_ptr(fn, dw1, "dw1");
  const int64_t w1_rows = is_gated(act) ? 2 * n : n;
  const GemmKernel chosen = (kernels ? *kernels : choose_kernels({plan.S, plan.E, d, n})).dw1;
  // Any E: this kernel has no per-CTA expert table.
  if (kernel == GatherKernel::ping_pong || kernel == GatherKernel::warp_specialized ||
      (kernel == GatherKernel::automatic && chosen.family == KernelFamily::ws_varlen_k)) {
    MOEBLAZE_UNSUPPORTED_IF(kernel == GatherKernel::ping_pong, fn,
                            ": GatherKernel::ping_pong is implemented for up_proj and dh_proj only");
    // An explicit warp_specialized keeps the chosen cluster count (1 where the choice was two_cta).
    const int cluster = chosen.family == KernelFamily::ws_varlen_k ? chosen.cluster : 1;
    detail::dw1_proj_ws(plan, dh, x, dw1, d, w1_rows, cluster, chosen.store_by_tma, stream);
    return;
  }
  sm90::VarlenKArgs a{};
  a.p = reinterpret_cast<const __nv_bfloat16*>(dh);  // (S, w1_rows): M = w1_rows
  a.p_gather = nullptr;
  a.q = reinterpret_cast<const __nv_bfloat16*>(x);  // (T, d): N = d, rows gathered
  a.q_gather = plan.expert_token_indices;
  a.offsets = plan.expert_token_offsets;
  a.M = static_cast<int>(w1_rows);
  a.N = static_cast<int>(d);
  a.n_tiles = static_cast<int>((d + sm90::kBN - 1) / sm90::kBN);
  a.out = reinterpret_cast<__nv_bfloat16*>(dw1);  // (E, w1_rows, d)
  sm90::launch_varlen_k(a, plan.E, stream);
}

}  // namespace moeblaze::cuda::gemm
