// The launchers' side of the kernel choice (kernel_config.hpp): resolving an explicit GatherKernel
// against the chosen one, and the TMA path's tile order and scratch.
#include <algorithm>

#include "cuda/gemm/grouped_gemm.hpp"
#include "cuda/gemm/dispatch/kernel_config.hpp"
#include "cuda/gemm/dispatch/tma_paths.hpp"
#include "cuda/gemm/dispatch/ws_paths.hpp"
#include "moeblaze/error.hpp"

namespace moeblaze::cuda::gemm {

namespace detail {
GatherPath gather_path(const GemmKernel& k) {
  if (k.family == KernelFamily::two_cta) return GatherPath::two_cta;
  return k.schedule == KernelSchedule::ping_pong ? GatherPath::ping_pong : GatherPath::cooperative;
}

GatherPath resolve_gather_path(const char* fn, GatherKernel kernel, int64_t E,
                               const GemmKernel& chosen, bool has_ping_pong) {
  MOEBLAZE_UNSUPPORTED_IF(kernel == GatherKernel::ping_pong && !has_ping_pong, fn,
                          ": GatherKernel::ping_pong is implemented for up_proj and dh_proj only");
  MOEBLAZE_UNSUPPORTED_IF(
      (kernel == GatherKernel::warp_specialized || kernel == GatherKernel::ping_pong) &&
          !ws_gather_supports(E),
      fn, ": the warp-specialised kernel takes E <= 4096 experts (got ", E, ")");
  switch (kernel) {
    case GatherKernel::two_cta: return GatherPath::two_cta;
    case GatherKernel::warp_specialized: return GatherPath::cooperative;
    case GatherKernel::ping_pong: return GatherPath::ping_pong;
    case GatherKernel::automatic: break;
  }
  return gather_path(chosen);
}

TmaTileOrder tma_tile_order() {
  const KernelOverrides o = kernel_overrides();
  const GemmKernel defaults;
  return {o.tma_along_n.value_or(defaults.tma_along_n),
          o.tma_swizzle.value_or(defaults.tma_swizzle), o.tma_bands.value_or(defaults.tma_bands)};
}
}  // namespace detail

size_t tma_gemm_scratch_bytes(int64_t E) {
  const int e = static_cast<int>(E);
  return std::max(detail::down_proj_tma_scratch_bytes(e), detail::dx_proj_tma_scratch_bytes(e));
}

size_t layer_gemm_scratch_bytes(int64_t S, int64_t E) {
  const LayerKernels k = contiguous_kernels(S, E, kernel_overrides());
  const bool tma = k.down.family == KernelFamily::tma_grouped ||
                   k.dx.family == KernelFamily::tma_grouped;
  return tma && E > 0 ? tma_gemm_scratch_bytes(E) : 0;
}

}  // namespace moeblaze::cuda::gemm
