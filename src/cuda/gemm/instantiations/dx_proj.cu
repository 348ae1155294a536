// (6) dX̃: dx_slots[r, :] = W1_eᵀ dh[r, :] — varlen-M, A = dh contiguous, B = w1 read N-major
// (the reduction runs over w1's rows), plain bf16 store. One instantiation:
// varlen_m_kernel<N-major B, StoreEpilogue>; with a scratch the TMA path of dx_proj_tma.cu runs
// instead, and where the chosen kernel is ws_gather the warp-specialised kernel (dx_proj_ws.cu,
// dx_proj_pp.cu).
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
void dx_proj_ranges(const GemmKernel& k, const RoutingPlanView& plan, const ExpertRows& rows,
                    const bf16* dh, const bf16* w1, bf16* dx, int64_t d, int64_t w1_rows,
                    GemmScratch scratch, cudaStream_t stream) {
  if (k.family == KernelFamily::ws_gather)
    (k.schedule == KernelSchedule::ping_pong ? detail::dx_proj_pp : detail::dx_proj_ws)(
        plan, rows, dh, w1, dx, d, w1_rows, stream);
  else
    detail::dx_proj_tma(plan, rows, dh, w1, dx, d, w1_rows, k, scratch, stream);
}

}  // namespace

void dx_proj(const RoutingPlanView& plan, const bf16* dh, const bf16* w1, bf16* dx_slots,
             int64_t d, int64_t n, Activation act, cudaStream_t stream, GemmScratch scratch) {
  detail::check_contiguous_a("dx_proj", plan, d, n, dh, "dh", w1, "w1", dx_slots, "dx_slots");
  const int64_t w1_rows = is_gated(act) ? 2 * n : n;
  const GemmKernel k = choose_kernels({plan.S, plan.E, d, n}).dx;
  // ws_gather, or the TMA path that the caller chose by giving a scratch (choose_kernels).
  if (k.family == KernelFamily::ws_gather || scratch.data)
    return dx_proj_ranges(k, plan, ExpertRows::whole(plan), dh, w1, dx_slots, d, w1_rows,
                          scratch, stream);

  sm90::VarlenMArgs p{};
  p.a = reinterpret_cast<const __nv_bfloat16*>(dh);  // (S, w1_rows)
  p.lda = w1_rows;
  p.a_gather = nullptr;
  p.b = reinterpret_cast<const __nv_bfloat16*>(w1);  // (E, w1_rows, d): K = w1_rows rows of N = d
  p.b_expert_stride = w1_rows * d;
  p.ldb = d;
  p.offsets = plan.expert_token_offsets;
  p.E = static_cast<int>(plan.E);
  p.K = static_cast<int>(w1_rows);
  p.N = static_cast<int>(d);
  p.n_tiles = static_cast<int>((d + sm90::kBN - 1) / sm90::kBN);
  p.gate_split = 0;
  sm90::StoreEpilogue::Params ep{reinterpret_cast<__nv_bfloat16*>(dx_slots), d,
                                 static_cast<int>(d)};
  sm90::launch_varlen_m<sm90::GMajor::MN, sm90::StoreEpilogue>(p, ep, plan.S,
                                                                sm90::raster_group(), stream);
}

void dx_proj_rows(const RoutingPlanView& plan, const ExpertRows& rows, const bf16* dh,
                  const bf16* w1, bf16* dx_rows, int64_t d, int64_t n, Activation act,
                  cudaStream_t stream, GemmScratch scratch, const LayerKernels* kernels) {
  detail::check_contiguous_a("dx_proj_rows", plan, d, n, dh, "dh", w1, "w1", dx_rows, "dx_rows");
  const GemmKernel k = (kernels ? *kernels : choose_kernels({plan.S, plan.E, d, n})).dx;
  detail::check_rows("dx_proj_rows", plan, rows,
                     k.family == KernelFamily::ws_gather || scratch.data != nullptr);
  dx_proj_ranges(k, plan, rows, dh, w1, dx_rows, d, is_gated(act) ? 2 * n : n, scratch, stream);
}

}  // namespace moeblaze::cuda::gemm
