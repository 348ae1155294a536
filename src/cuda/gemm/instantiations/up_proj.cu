// (1) up-projection with the activation fused into the epilogue — varlen-M, A = x gathered
// through expert_token_indices, B = w1 K-major. For gated activations a CTA's 128 B rows are 64
// gate rows j and the 64 up rows n + j of the same j (VarlenMArgs::gate_split), so its
// accumulators hold g and u of the same column j in the same thread: columns c and c + 64 of the
// WGMMA fragment (frag_col(i) and frag_col(i + 8)). One instantiation:
// varlen_m_kernel<K-major B, ActEpilogue>.
#include "cuda/gemm/epilogues/act_epilogue.cuh"
#include "cuda/gemm/dispatch/gemm_checks.hpp"
#include "cuda/gemm/dispatch/raster.hpp"
#include "cuda/gemm/grouped_gemm.hpp"
#include "cuda/gemm/kernels/sm90_varlen_m.cuh"
#include "cuda/gemm/dispatch/ws_paths.hpp"

namespace moeblaze::cuda::gemm {
namespace sm90 {

// The 2-CTA kernel's side of the shared epilogue (act_epilogue.cuh).
struct ActEpilogue {
  static constexpr int kMmaInFlight = 1;
  using Params = ActParams;
  using Prefetched = NoPrefetch;
  __device__ static void prefetch(const Params&, Prefetched&, int, int, int) {}
  template <class Acc>
  __device__ static void apply(const Params& p, Acc& acc, const Prefetched&, int m_begin,
                               int m_end, int n_tile, int expert) {
    act_epilogue<TwoCtaFrag>(p, acc, m_begin, m_end, n_tile, expert);
  }
};

}  // namespace sm90

void up_proj(const RoutingPlanView& plan, const bf16* x, const bf16* w1, bf16* h, bf16* a,
             int64_t d, int64_t n, Activation act, cudaStream_t stream, GatherKernel kernel,
             const bf16* b1, const LayerKernels* kernels) {
  constexpr const char* fn = "up_proj";
  detail::check_plan(fn, plan, /*gathers=*/true, /*weights=*/false);
  detail::check_dims(fn, d, n);
  detail::check_gpu_activation(fn, act, plan.E);
  detail::check_ptr(fn, x, "x", plan.S > 0);
  detail::check_ptr(fn, w1, "w1", plan.S > 0);
  MOEBLAZE_REQUIRE(reinterpret_cast<uintptr_t>(b1) % 16 == 0, fn, ": b1 must be 16-byte aligned");
  MOEBLAZE_REQUIRE(plan.S == 0 || h != nullptr || a != nullptr, fn,
                   ": h and a must not both be null");
  using detail::GatherPath;
  const bool oai = act == Activation::swiglu_oai;
  const GemmKernel chosen = (kernels ? *kernels : choose_kernels({plan.S, plan.E, d, n, act})).up;
  const GatherPath path = detail::resolve_gather_path(fn, kernel, plan.E, chosen,
                                                      /*has_ping_pong=*/true);
  if (oai) {
    MOEBLAZE_UNSUPPORTED_IF(path != GatherPath::cooperative, fn, ": swiglu_oai runs on its own "
                            "warp-specialised cooperative kernel only (GatherKernel automatic or "
                            "warp_specialized)");
    return detail::up_proj_oai(plan, x, w1, b1, h, a, d, n, stream);
  }
  // Clusters of 2 (up.cluster=2) where the chosen kernel is this one: an explicit GatherKernel
  // names a schedule, not a cluster, and keeps single CTAs.
  const bool cluster = kernel == GatherKernel::automatic && chosen.cluster == 2;
  if (path == GatherPath::cooperative)
    return (cluster ? detail::up_proj_mc : detail::up_proj_ws)(plan, x, w1, b1, h, a, d, n, act,
                                                               stream);
  if (path == GatherPath::ping_pong)
    return detail::up_proj_pp(plan, x, w1, b1, h, a, d, n, act, stream);
  const bool gated = is_gated(act);
  const int64_t w1_rows = gated ? 2 * n : n;

  sm90::VarlenMArgs p{};
  p.a = reinterpret_cast<const __nv_bfloat16*>(x);  // (T, d), rows gathered per slot
  p.lda = d;
  p.a_gather = plan.expert_token_indices;
  p.b = reinterpret_cast<const __nv_bfloat16*>(w1);  // (E, w1_rows, d)
  p.b_expert_stride = w1_rows * d;
  p.ldb = d;
  p.offsets = plan.expert_token_offsets;
  p.E = static_cast<int>(plan.E);
  p.K = static_cast<int>(d);
  p.N = static_cast<int>(n);
  p.n_tiles = static_cast<int>(gated ? n / (sm90::kBN / 2) : (n + sm90::kBN - 1) / sm90::kBN);
  p.gate_split = gated ? static_cast<int>(n) : 0;
  sm90::ActParams ep{reinterpret_cast<__nv_bfloat16*>(h), reinterpret_cast<__nv_bfloat16*>(a),
                     static_cast<int>(n), act, reinterpret_cast<const __nv_bfloat16*>(b1)};
  if (chosen.b_by_tma || chosen.family != KernelFamily::two_cta)
    sm90::launch_varlen_m<sm90::GMajor::K, sm90::ActEpilogue, true>(p, ep, plan.S,
                                                                    sm90::raster_group(), stream);
  else
    sm90::launch_varlen_m<sm90::GMajor::K, sm90::ActEpilogue, false>(p, ep, plan.S,
                                                                     sm90::raster_group(), stream);
}

}  // namespace moeblaze::cuda::gemm
