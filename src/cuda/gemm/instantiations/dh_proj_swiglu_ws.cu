// (4) dH for swiglu alone on the warp-specialised kernel, cooperative schedule (128 x 256 tiles):
// the default activation's own instantiation, without the activation switch (which costs the
// epilogue a spill), its H read from shared memory (GatherDhEpilogue's kStageH). One
// instantiation: gather_gemm_kernel<N-major B, GatherDhEpilogue<WsFrag, swiglu, true>,
// Cooperative>, for E <= kWsDhSwigluCoopMaxExperts (dh_proj takes the switch kernel above).
#include "cuda/gemm/kernels/ws_gather_gemms.cuh"
#include "cuda/gemm/dispatch/raster.hpp"
#include "cuda/gemm/dispatch/ws_paths.hpp"

namespace moeblaze::cuda::gemm::detail {

using StagedDh = sm90::ws::GatherDhEpilogue<sm90::ws::WsFrag, static_cast<int>(Activation::swiglu),
                                            /*kStageH=*/true>;
static_assert(sm90::ws::smem_bytes<sm90::ws::Cooperative, StagedDh>(
                  static_cast<int>(kWsDhSwigluCoopMaxExperts)) <= sm90::ws::kMaxDynamicSmem,
              "kWsDhSwigluCoopMaxExperts: the tile table no longer fits beside the staged H");

void dh_proj_swiglu_ws(const RoutingPlanView& plan, const bf16* d_out, const bf16* w2,
                       const bf16* h, float* ds_partials, bf16* dh, bf16* a_scaled, int64_t d,
                       int64_t n, cudaStream_t stream) {
  sm90::ws::dh_proj_gather<sm90::ws::Cooperative, static_cast<int>(Activation::swiglu), true>(
      plan, d_out, w2, h, ds_partials, ds_partials_cols(n), dh, a_scaled, d, n,
      Activation::swiglu, sm90::raster_group(), stream);
}

}  // namespace moeblaze::cuda::gemm::detail
