// (2) down-projection on the warp-specialised kernel, ping-pong schedule (128 x 128 tiles: one
// warpgroup's stores under the other's mainloop), A by TMA (no gather).
// One instantiation: gather_gemm_kernel<K-major B, GatherStoreEpilogue<PingFrag>, PingPong,
// kTmaA = true>.
#include "cuda/gemm/kernels/ws_gather_gemms.cuh"
#include "cuda/gemm/dispatch/raster.hpp"
#include "cuda/gemm/dispatch/ws_paths.hpp"

namespace moeblaze::cuda::gemm::detail {

void down_proj_pp(const RoutingPlanView& plan, const ExpertRows& rows, const bf16* a,
                  const bf16* w2, bf16* y, int64_t d, int64_t n, cudaStream_t stream) {
  sm90::ws::down_proj_contiguous<sm90::ws::PingPong>(plan, rows, a, w2, y, d, n,
                                                     sm90::raster_group(), stream);
}

}  // namespace moeblaze::cuda::gemm::detail
