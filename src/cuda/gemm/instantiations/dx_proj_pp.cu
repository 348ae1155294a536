// (6) dX̃ on the warp-specialised kernel, ping-pong schedule (128 x 128 tiles: one
// warpgroup's stores under the other's mainloop), A by TMA (no gather).
// One instantiation: gather_gemm_kernel<N-major B, GatherStoreEpilogue<PingFrag>, PingPong,
// kTmaA = true>.
#include "cuda/gemm/kernels/ws_gather_gemms.cuh"
#include "cuda/gemm/dispatch/raster.hpp"
#include "cuda/gemm/dispatch/ws_paths.hpp"

namespace moeblaze::cuda::gemm::detail {

void dx_proj_pp(const RoutingPlanView& plan, const ExpertRows& rows, const bf16* dh,
                const bf16* w1, bf16* dx_slots, int64_t d, int64_t w1_rows, cudaStream_t stream) {
  sm90::ws::dx_proj_contiguous<sm90::ws::PingPong>(plan, rows, dh, w1, dx_slots, d, w1_rows,
                                                   sm90::raster_group(), stream);
}

}  // namespace moeblaze::cuda::gemm::detail
