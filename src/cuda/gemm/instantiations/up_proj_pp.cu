// (1) up-projection on the warp-specialised kernel, ping-pong schedule (128 x 128 tiles, one per
// consumer warpgroup, epilogues under the other warpgroup's mainloop).
// One instantiation: gather_gemm_kernel<K-major B, GatherActEpilogue<PingFrag>, PingPong>.
#include "cuda/gemm/kernels/ws_gather_gemms.cuh"
#include "cuda/gemm/dispatch/raster.hpp"
#include "cuda/gemm/dispatch/ws_paths.hpp"

namespace moeblaze::cuda::gemm::detail {

void up_proj_pp(const RoutingPlanView& plan, const bf16* x, const bf16* w1, const bf16* b1, bf16* h,
                bf16* a, int64_t d, int64_t n, Activation act, cudaStream_t stream) {
  sm90::ws::up_proj_gather<sm90::ws::PingPong>(plan, x, w1, b1, h, a, d, n, act, sm90::raster_group(),
                                               stream);
}

}  // namespace moeblaze::cuda::gemm::detail
