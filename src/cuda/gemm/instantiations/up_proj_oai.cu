// (1) up-projection for swiglu_oai (gpt-oss's clamped SwiGLU) on the warp-specialised kernel,
// cooperative schedule: its own instantiation, as the shared activation switch leaves it out
// (cuda/activation.cuh). One instantiation:
// gather_gemm_kernel<K-major B, GatherActEpilogue<WsFrag, kOai = true>, Cooperative>.
#include "cuda/gemm/kernels/ws_gather_gemms.cuh"
#include "cuda/gemm/dispatch/raster.hpp"
#include "cuda/gemm/dispatch/ws_paths.hpp"

namespace moeblaze::cuda::gemm::detail {

void up_proj_oai(const RoutingPlanView& plan, const bf16* x, const bf16* w1, const bf16* b1,
                 bf16* h, bf16* a, int64_t d, int64_t n, cudaStream_t stream) {
  sm90::ws::up_proj_gather<sm90::ws::Cooperative, /*kOai=*/true>(
      plan, x, w1, b1, h, a, d, n, Activation::swiglu_oai, sm90::raster_group(), stream);
}

}  // namespace moeblaze::cuda::gemm::detail
