// (1) up-projection on the warp-specialised cooperative kernel on clusters of 2: the two CTAs of
// a cluster take consecutive m-tiles of one expert and share each stage of w1 by TMA multicast
// (gather_gemm_kernel's kCluster), otherwise up_proj_ws.cu's kernel. One instantiation:
// gather_gemm_kernel<K-major B, GatherActEpilogue<WsFrag>, Cooperative, false, 2> (the
// up.cluster=2 override).
#include "cuda/gemm/kernels/ws_gather_gemms.cuh"
#include "cuda/gemm/dispatch/raster.hpp"
#include "cuda/gemm/dispatch/ws_paths.hpp"

namespace moeblaze::cuda::gemm::detail {

void up_proj_mc(const RoutingPlanView& plan, const bf16* x, const bf16* w1, const bf16* b1, bf16* h,
                bf16* a, int64_t d, int64_t n, Activation act, cudaStream_t stream) {
  sm90::ws::up_proj_gather<sm90::ws::Cooperative, /*kOai=*/false, /*kCluster=*/2>(
      plan, x, w1, b1, h, a, d, n, act, sm90::raster_group(), stream);
}

}  // namespace moeblaze::cuda::gemm::detail
