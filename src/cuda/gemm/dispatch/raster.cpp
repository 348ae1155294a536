// The varlen kernels' CTA band height: kernel_config.hpp's `raster` override or its default.
#include "cuda/gemm/dispatch/raster.hpp"

#include "cuda/gemm/dispatch/kernel_config.hpp"

namespace moeblaze::cuda::gemm::sm90 {

int raster_group() { return kernel_overrides().raster_group.value_or(kDefaultRasterGroup); }

}  // namespace moeblaze::cuda::gemm::sm90
