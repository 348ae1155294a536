// (1) up-projection on the warp-specialised kernel, cooperative schedule (128 x 256 tiles).
// One instantiation: gather_gemm_kernel<K-major B, GatherActEpilogue<WsFrag>, Cooperative>.
#include "cuda/gemm/kernels/ws_gather_gemms.cuh"
#include "cuda/gemm/dispatch/raster.hpp"
#include "cuda/gemm/dispatch/ws_paths.hpp"

namespace moeblaze::cuda::gemm::detail {

static_assert(sm90::ws::kMaxExperts == kWsMaxExperts, "kernel_config.hpp's constant");
static_assert(sm90::ws::Cooperative::kStages == kWsCooperativeStages, "kernel_config.hpp");
static_assert(sm90::ws::PingPong::kStages == kWsPingPongStages, "kernel_config.hpp");

bool ws_gather_supports(int64_t E) { return E >= 1 && E <= kWsMaxExperts; }

void up_proj_ws(const RoutingPlanView& plan, const bf16* x, const bf16* w1, const bf16* b1, bf16* h,
                bf16* a, int64_t d, int64_t n, Activation act, cudaStream_t stream) {
  sm90::ws::up_proj_gather<sm90::ws::Cooperative>(plan, x, w1, b1, h, a, d, n, act,
                                                  sm90::raster_group(), stream);
}

}  // namespace moeblaze::cuda::gemm::detail
