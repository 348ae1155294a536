// (2) down-projection: y[r, :] = W2_e a[r, :] — varlen-M, A contiguous, B = w2 K-major, plain
// bf16 store. One instantiation: varlen_m_kernel<K-major B, StoreEpilogue>; with a scratch the
// TMA path of down_proj_tma.cu runs instead, and where the chosen kernel is ws_gather the
// warp-specialised kernel (down_proj_ws.cu, down_proj_pp.cu).
#include "cuda/gemm/dispatch/gemm_checks.hpp"
#include "cuda/gemm/dispatch/raster.hpp"
#include "cuda/gemm/grouped_gemm.hpp"
#include "cuda/gemm/kernels/sm90_varlen_m.cuh"
#include "cuda/gemm/dispatch/tma_paths.hpp"
#include "cuda/gemm/dispatch/ws_paths.hpp"

namespace moeblaze::cuda::gemm {
namespace {

// The two paths that take row ranges: the warp-specialised kernel where the chosen kernel k is
// ws_gather, else the TMA path (which needs the scratch).
void down_proj_ranges(const GemmKernel& k, const RoutingPlanView& plan, const ExpertRows& rows,
                      const bf16* a, const bf16* w2, bf16* y, int64_t d, int64_t n,
                      GemmScratch scratch, cudaStream_t stream) {
  if (k.family == KernelFamily::ws_gather)
    (k.schedule == KernelSchedule::ping_pong ? detail::down_proj_pp : detail::down_proj_ws)(
        plan, rows, a, w2, y, d, n, stream);
  else
    detail::down_proj_tma(plan, rows, a, w2, y, d, n, k, scratch, stream);
}

}  // namespace

void down_proj(const RoutingPlanView& plan, const bf16* a, const bf16* w2, bf16* y, int64_t d,
               int64_t n, cudaStream_t stream, GemmScratch scratch) {
  detail::check_contiguous_a("down_proj", plan, d, n, a, "a", w2, "w2", y, "y");
  const GemmKernel k = choose_kernels({plan.S, plan.E, d, n}).down;
  // ws_gather, or the TMA path that the caller chose by giving a scratch (choose_kernels).
  if (k.family == KernelFamily::ws_gather || scratch.data)
    return down_proj_ranges(k, plan, ExpertRows::whole(plan), a, w2, y, d, n, scratch, stream);

  sm90::VarlenMArgs p{};
  p.a = reinterpret_cast<const __nv_bfloat16*>(a);  // (S, n)
  p.lda = n;
  p.a_gather = nullptr;
  p.b = reinterpret_cast<const __nv_bfloat16*>(w2);  // (E, d, n): N = d rows of K = n
  p.b_expert_stride = d * n;
  p.ldb = n;
  p.offsets = plan.expert_token_offsets;
  p.E = static_cast<int>(plan.E);
  p.K = static_cast<int>(n);
  p.N = static_cast<int>(d);
  p.n_tiles = static_cast<int>((d + sm90::kBN - 1) / sm90::kBN);
  p.gate_split = 0;
  sm90::StoreEpilogue::Params ep{reinterpret_cast<__nv_bfloat16*>(y), d, static_cast<int>(d)};
  sm90::launch_varlen_m<sm90::GMajor::K, sm90::StoreEpilogue>(p, ep, plan.S,
                                                               sm90::raster_group(), stream);
}

void down_proj_rows(const RoutingPlanView& plan, const ExpertRows& rows, const bf16* a,
                    const bf16* w2, bf16* y_rows, int64_t d, int64_t n, cudaStream_t stream,
                    GemmScratch scratch) {
  detail::check_contiguous_a("down_proj_rows", plan, d, n, a, "a", w2, "w2", y_rows, "y_rows");
  const GemmKernel k = choose_kernels({plan.S, plan.E, d, n}).down;
  detail::check_rows("down_proj_rows", plan, rows,
                     k.family == KernelFamily::ws_gather || scratch.data != nullptr);
  down_proj_ranges(k, plan, rows, a, w2, y_rows, d, n, scratch, stream);
}

}  // namespace moeblaze::cuda::gemm
