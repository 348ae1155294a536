// (4) dH for swiglu on the warp-specialised cooperative kernel on clusters of 2: the two CTAs of a
// cluster take consecutive m-tiles of one expert and share each stage of w2 by TMA multicast
// (gather_gemm_kernel's kCluster), otherwise dh_proj_swiglu_ws.cu's kernel, H staged in shared
// memory. One instantiation: gather_gemm_kernel<N-major B, GatherDhEpilogue<WsFrag, swiglu,
// true>, Cooperative, false, 2>, for E <= kWsDhSwigluCoopMaxExperts (the dh.cluster=2 override).
#include "cuda/gemm/kernels/ws_gather_gemms.cuh"
#include "cuda/gemm/dispatch/raster.hpp"
#include "cuda/gemm/dispatch/ws_paths.hpp"

namespace moeblaze::cuda::gemm::detail {

void dh_proj_swiglu_mc(const RoutingPlanView& plan, const bf16* d_out, const bf16* w2,
                       const bf16* h, float* ds_partials, bf16* dh, bf16* a_scaled, int64_t d,
                       int64_t n, cudaStream_t stream) {
  sm90::ws::dh_proj_gather<sm90::ws::Cooperative, static_cast<int>(Activation::swiglu), true,
                           /*kCluster=*/2>(plan, d_out, w2, h, ds_partials, ds_partials_cols(n),
                                           dh, a_scaled, d, n, Activation::swiglu,
                                           sm90::raster_group(), stream);
}

}  // namespace moeblaze::cuda::gemm::detail
