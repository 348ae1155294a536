// (4) dH for swiglu_oai (gpt-oss's clamped SwiGLU) on the warp-specialised kernel, cooperative
// schedule: its own instantiation, as the shared activation switch leaves it out
// (cuda/activation.cuh). One instantiation:
// gather_gemm_kernel<N-major B, GatherDhEpilogue<WsFrag, swiglu_oai>, Cooperative>.
#include "cuda/gemm/kernels/ws_gather_gemms.cuh"
#include "cuda/gemm/dispatch/raster.hpp"
#include "cuda/gemm/dispatch/ws_paths.hpp"

namespace moeblaze::cuda::gemm::detail {

void dh_proj_oai(const RoutingPlanView& plan, const bf16* d_out, const bf16* w2, const bf16* h,
                 float* ds_partials, bf16* dh, bf16* a_scaled, int64_t d, int64_t n,
                 cudaStream_t stream) {
  sm90::ws::dh_proj_gather<sm90::ws::Cooperative, static_cast<int>(Activation::swiglu_oai)>(
      plan, d_out, w2, h, ds_partials, ds_partials_cols(n), dh, a_scaled, d, n,
      Activation::swiglu_oai, sm90::raster_group(), stream);
}

}  // namespace moeblaze::cuda::gemm::detail
